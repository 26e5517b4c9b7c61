"""bench.capacity's command line."""

from __future__ import annotations

import argparse

from bench.common import add_model_option
from specrag.pipeline.models.catalog import DEFAULT_MODEL_NAME

__all__ = ["parse_args"]

QUICK_RATES = (5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
FULL_RATES = (5.0, 10.0, 20.0, 30.0, 40.0, 60.0, 80.0, 120.0, 160.0, 240.0, 320.0)


def _numbers(text: str) -> tuple[float, ...]:
    values = tuple(float(part) for part in text.split(","))
    if not values or any(value <= 0 for value in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers such as 5,10,20, got {text!r}")
    return values


def _counts(text: str) -> tuple[int, ...]:
    values = tuple(int(part) for part in text.split(","))
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"expected replica counts such as 1,4, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.capacity",
        description="Answers/s specrag serves in front of GPU-pace stand-ins, against a thin RAG front end.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="6 rates of 8 s each (10 min 6 s in all with the embedding served elsewhere, on a 2-core "
        "machine at load 6-8; under 15 min)",
    )
    add_model_option(parser, DEFAULT_MODEL_NAME, "its tokenizer builds the prompts; the stand-ins serve them")
    parser.add_argument("--data-dir", help="data directory (default: $SPECRAG_DATA_DIR or ./data)")
    parser.add_argument(
        "--rates", type=_numbers, help="offered answers/s, rising (default: quick or full set)"
    )
    parser.add_argument("--seconds", type=float, help="seconds of arrivals per rate (default 8, full 20)")
    parser.add_argument("--replicas", type=_counts, default=(1, 4), help="stand-in counts (default 1,4)")
    parser.add_argument("-k", type=int, default=10, help="passages per prompt (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default %(default)s)")
    parser.add_argument("--service-cpus", default="0", help="cores of the front end's process (default 0)")
    parser.add_argument(
        "--client-cpus", default="1", help="cores of the load generator and the stand-ins (default 1)"
    )
    parser.add_argument("--no-pin", action="store_true", help="leave every process on every core")
    parser.add_argument(
        "--no-mirror-rate",
        action="store_true",
        help="skip bench.capacity.mirror_rate (the block-event rate one KV mirror follows with 0 lost "
        "batches; 60 s a rate, 10 s with --quick), run first and reported as mirror_events_per_s_*",
    )
    parser.add_argument(
        "--no-embedding-elsewhere",
        action="store_true",
        help="skip the configuration whose questions the embedding stand-in embeds "
        "(python -m specrag.sim.embedding_server; run in front of the most replicas, reported as "
        "capacity_answers_per_s_embedding_elsewhere and the like)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="sample each front's CPU by component and function over its sweep "
        "(bench.capacity.profile_sampler), reported under 'profiles' in the JSON",
    )
    parser.add_argument("--name", default="capacity", help="bench/out/NAME.json and NAME.png")
    args = parser.parse_args(argv)
    args.rates = args.rates or (QUICK_RATES if args.quick else FULL_RATES)
    args.seconds = args.seconds or (8.0 if args.quick else 20.0)
    if args.seconds <= 0:
        parser.error("--seconds must be positive")
    if args.no_pin:
        args.service_cpus = args.client_cpus = None
    return args
