"""``python -m specrag.sim.gpu_server --port N --kv-events-port M``: one stand-in replica until
interrupted (SIGINT or SIGTERM stop it cleanly). See :mod:`specrag.sim.gpu_server`."""

from __future__ import annotations

import argparse
import sys

from specrag.errors import InvalidInputError
from specrag.sim.gpu_server.server import HOST, StandInServer, StandInSettings
from specrag.sim.gpu_server.time_model import TimeModel
from specrag.sim.signals import run_until_interrupted, stop_on_signals

_DEFAULTS = StandInSettings(port=8000, kv_events_port=5557)
_TIMES = TimeModel()


def parse_settings(argv: list[str] | None = None) -> StandInSettings:
    parser = argparse.ArgumentParser(
        prog="python -m specrag.sim.gpu_server",
        description="A GPU-pace vLLM stand-in (for measuring specrag's own work; never a model's latency).",
    )
    parser.add_argument("--port", type=int, required=True, help=f"HTTP port on {HOST}")
    parser.add_argument(
        "--kv-events-port", type=int, required=True, help="KV events on this port, replays on the next"
    )
    parser.add_argument(
        "--model", default=_DEFAULTS.model, help="the served model name (default %(default)s)"
    )
    parser.add_argument("--max-model-len", type=int, default=_DEFAULTS.max_model_len)
    parser.add_argument("--block-size", type=int, default=_DEFAULTS.block_size)
    parser.add_argument(
        "--num-blocks", type=int, default=_DEFAULTS.num_blocks, help="KV blocks in the prefix cache"
    )
    parser.add_argument("--prefill-us-per-token", type=float, default=_TIMES.prefill_s_per_token * 1e6)
    parser.add_argument("--step-ms", type=float, default=_TIMES.step_s * 1e3, help="every step's own time")
    parser.add_argument("--max-num-batched-tokens", type=int, default=_TIMES.max_num_batched_tokens)
    parser.add_argument("--max-num-seqs", type=int, default=_TIMES.max_num_seqs)
    args = parser.parse_args(argv)
    try:
        times = TimeModel(
            prefill_s_per_token=args.prefill_us_per_token / 1e6,
            step_s=args.step_ms / 1e3,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
        )
        return StandInSettings(
            port=args.port,
            kv_events_port=args.kv_events_port,
            model=args.model,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            time_model=times,
        )
    except InvalidInputError as error:
        parser.error(str(error))


async def serve(settings: StandInSettings) -> None:
    stop = stop_on_signals()
    async with StandInServer(settings):
        print(
            f"GPU stand-in on http://{HOST}:{settings.port}, KV events on tcp://{HOST}:{settings.kv_events_port}",
            flush=True,
        )
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    return run_until_interrupted(serve(parse_settings(argv)))


if __name__ == "__main__":
    sys.exit(main())
