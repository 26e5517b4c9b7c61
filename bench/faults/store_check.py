"""What verifying the document store costs: a checksum per row checked on read, against a digest of
the whole file checked at open (issue 35, item 1).

Rerun: ``.venv/bin/python -m bench.faults.store_check --quick`` (about 2 minutes here; without
``--quick`` the large store has 200,000 passages instead of 100,000). Builds two stores in a
scratch directory, with the embedded default model's tokenizer (converted into the data
directory if missing):

- ``default``: the embedded default corpus (1,593 passages), as ``specrag prepare`` builds it;
- ``large``: that corpus repeated to ``--large`` passages (each copy keeps its passage's tokens:
  the checks' cost depends on the bytes, not on what they say).

For each store, in the same run: the time to open it (``DocumentStore``), to hash the whole file
(SHA-256, page cache warm: what checking a file digest at every open would add), and to verify
every row's checksum (a full scan); and the time of one row read without a check (the schema-1
read: ``SELECT tokens``) and with the per-row check (``DocumentStore.tokens`` without its cache),
over ``--reads`` random rows: medians and p99 with 95 % bootstrap intervals of the median.

Output: bench/out/store_check.json, store_check.png, and the JSON summary as the last line.
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import machine, print_summary, save_figure, write_report
from specrag.atomic import sha256_file
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.models.catalog import DEFAULT_MODEL_NAME, ensure_named_model
from specrag.pipeline.models.tokenizer import Tokenizer
from specrag.pipeline.store.document_store import DocumentStore, build_store
from specrag.retrieval.corpus import Passage, build_default_corpus

__all__ = ["main"]

_TOKEN_DTYPE = np.dtype("<u4")
_BOOTSTRAP = 2000


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _stats(seconds: list[float], rng: np.random.Generator) -> dict[str, Any]:
    """Median and p99 in microseconds, with a 95 % bootstrap interval of the median."""
    values = np.asarray(seconds) * 1e6
    picks = rng.integers(0, len(values), size=(_BOOTSTRAP, len(values)))
    low, high = np.percentile(np.median(values[picks], axis=1), [2.5, 97.5])
    return {
        "median_us": float(np.median(values)),
        "median_ci_us": [float(low), float(high)],
        "p99_us": float(np.percentile(values, 99)),
        "n": len(values),
    }


def _large_corpus(base: list[Passage], size: int) -> list[Passage]:
    return [
        Passage(
            id=f"{base[i % len(base)].id}~{i // len(base)}",
            title=base[i % len(base)].title,
            text=base[i % len(base)].text,
        )
        for i in range(size)
    ]


def _build(path: Path, passages: list[Passage], base_tokens: list[list[int]], fingerprint: str) -> None:
    """Build a store whose row ``i`` holds the tokens of base passage ``i mod len(base)``."""
    done = 0

    def tokenize_batch(texts: list[str]) -> list[list[int]]:
        nonlocal done
        tokens = [base_tokens[(done + offset) % len(base_tokens)] for offset in range(len(texts))]
        done += len(texts)
        return tokens

    build_store(path, passages, tokenize_batch, fingerprint)


def _unchecked_read(connection: sqlite3.Connection, row: int) -> tuple[int, ...]:
    (blob,) = connection.execute("SELECT tokens FROM passages WHERE row = ?", (row,)).fetchone()
    return tuple(int(token) for token in np.frombuffer(blob, dtype=_TOKEN_DTYPE))


def _measure(path: Path, reads: int, repeats: int, rng: np.random.Generator) -> dict[str, Any]:
    opens = [_timed(lambda: DocumentStore(path).close()) for _ in range(repeats)]
    sha256_file(path)  # page cache warm, as for a service restarted on the same machine
    digests = [_timed(lambda: sha256_file(path)) for _ in range(repeats)]
    store = DocumentStore(path)
    scans = [_timed(lambda: [store._verified_row(row) for row in range(len(store))]) for _ in range(repeats)]
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    picker = random.Random(0)
    rows = [picker.randrange(len(store)) for _ in range(reads)]
    unchecked, checked = [], []
    for row in rows:  # interleaved, so both see the same cache and machine state
        unchecked.append(_timed(lambda row=row: _unchecked_read(connection, row)))  # type: ignore[misc]
        checked.append(_timed(lambda row=row: DocumentStore.tokens.__wrapped__(store, row)))  # type: ignore[misc]
    connection.close()
    store.close()
    return {
        "passages": len(store),
        "file_mib": path.stat().st_size / (1 << 20),
        "open": _stats(opens, rng),
        "whole_file_sha256": _stats(digests, rng),
        "verify_every_row": _stats(scans, rng),
        "row_read_unchecked": _stats(unchecked, rng),
        "row_read_checked": _stats(checked, rng),
    }


def _draw(results: dict[str, dict[str, Any]], path: Path) -> None:
    from matplotlib import pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(results)
    width = 0.25
    for offset, (key, label) in enumerate(
        [
            ("open", "open"),
            ("whole_file_sha256", "+ whole-file SHA-256"),
            ("verify_every_row", "verify every row"),
        ]
    ):
        values = [results[name][key]["median_us"] / 1e3 for name in names]
        left.bar(np.arange(len(names)) + (offset - 1) * width, values, width, label=label)
    left.set_xticks(np.arange(len(names)), [f"{n}\n{results[n]['passages']:,} passages" for n in names])
    left.set_yscale("log")
    left.set_ylabel("ms (median)")
    left.set_title("At open")
    left.legend()
    for offset, (key, label) in enumerate(
        [("row_read_unchecked", "unchecked"), ("row_read_checked", "checked")]
    ):
        medians = [results[name][key]["median_us"] for name in names]
        p99 = [results[name][key]["p99_us"] for name in names]
        x = np.arange(len(names)) + (offset - 0.5) * width
        right.bar(x, medians, width, label=f"{label} (median)")
        right.scatter(x, p99, marker="_", s=200, color="black")
    right.set_xticks(np.arange(len(names)), names)
    right.set_ylabel("µs per row read (bar: median, dash: p99)")
    right.set_title("Per row, on read")
    right.legend()
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a 100,000-passage large store, fewer repeats")
    parser.add_argument("--large", type=int, default=None, help="passages of the large store")
    parser.add_argument("--reads", type=int, default=5000, help="random row reads timed per store")
    args = parser.parse_args(argv)
    large = args.large or (100_000 if args.quick else 200_000)
    repeats = 5 if args.quick else 15
    rng = np.random.default_rng(0)
    model_dir = ensure_named_model(DataLayout(resolve_data_dir()), DEFAULT_MODEL_NAME, ())
    tokenizer = Tokenizer(model_dir)
    base = build_default_corpus()
    with tempfile.TemporaryDirectory() as scratch:
        default_path = Path(scratch) / "default.sqlite"
        build_store(default_path, base, tokenizer.encode_batch, tokenizer.fingerprint)
        store = DocumentStore(default_path)
        base_tokens = [list(store.tokens(row)) for row in range(len(store))]
        store.close()
        large_path = Path(scratch) / "large.sqlite"
        _build(large_path, _large_corpus(base, large), base_tokens, tokenizer.fingerprint)
        results = {
            "default": _measure(default_path, args.reads, repeats, rng),
            "large": _measure(large_path, args.reads, repeats, rng),
        }
    data = {"machine": machine(), "quick": args.quick, "results": results}
    json_path, png_path = write_report("store_check", data, lambda path: _draw(results, path))
    for name, result in results.items():
        unchecked, checked = result["row_read_unchecked"], result["row_read_checked"]
        print(
            f"{name}: {result['passages']:,} passages, {result['file_mib']:.1f} MiB; open "
            f"{result['open']['median_us'] / 1e3:.2f} ms, whole-file SHA-256 "
            f"{result['whole_file_sha256']['median_us'] / 1e3:.1f} ms, verify every row "
            f"{result['verify_every_row']['median_us'] / 1e3:.1f} ms; row read unchecked "
            f"{unchecked['median_us']:.1f} µs (p99 {unchecked['p99_us']:.1f}), "
            f"checked {checked['median_us']:.1f} µs (p99 {checked['p99_us']:.1f})"
        )
    print(f"wrote {json_path} and {png_path}")
    summary = {
        name: {
            "passages": result["passages"],
            "open_ms": round(result["open"]["median_us"] / 1e3, 2),
            "whole_file_sha256_ms": round(result["whole_file_sha256"]["median_us"] / 1e3, 1),
            "verify_every_row_ms": round(result["verify_every_row"]["median_us"] / 1e3, 1),
            "row_read_unchecked_us": round(result["row_read_unchecked"]["median_us"], 1),
            "row_read_checked_us": round(result["row_read_checked"]["median_us"], 1),
        }
        for name, result in results.items()
    }
    print_summary(summary, rerun="bench.faults.store_check --quick")


if __name__ == "__main__":
    main()
