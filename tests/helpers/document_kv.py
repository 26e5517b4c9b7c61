"""Document-KV entries for the tests of the stores that remove them (replaced versions' KV)."""

from __future__ import annotations

from pathlib import Path

from specrag.pipeline.document_kv.store import SUFFIX, segment_key


def kv_entry(kv_dir: Path, tokens: tuple[int, ...]) -> Path:
    """A document-KV entry of a segment (its content does not matter here), as the store lays it out."""
    key = segment_key(tokens)
    path = kv_dir / "model-bfloat16-bs16" / key[:2] / f"{key}{SUFFIX}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"kv")
    return path
