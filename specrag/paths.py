"""Where generated artefacts live.

Everything specrag generates (default model, corpus, document store, indexes) goes to one data
directory so a user can delete or relocate it in one step. It is resolved, in order, from an
explicit argument, the ``SPECRAG_DATA_DIR`` environment variable, and ``./data`` (git-ignored in
the repository, which is where the README's commands run).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DATA_DIR_ENV", "DataLayout", "resolve_data_dir"]

DATA_DIR_ENV = "SPECRAG_DATA_DIR"


def resolve_data_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Return the data directory (not created) from the argument, the environment, or ``./data``."""
    if explicit is not None:
        return Path(explicit).expanduser().resolve()
    from_env = os.environ.get(DATA_DIR_ENV)
    if from_env:
        return Path(from_env).expanduser().resolve()
    return (Path.cwd() / "data").resolve()


@dataclass(frozen=True)
class DataLayout:
    """Fixed names inside the data directory, so every command finds what another one built."""

    root: Path

    def named_model_dir(self, name: str) -> Path:
        """Where a model specrag makes by name (the real default, the random one) lives."""
        return self.root / "models" / name

    @property
    def corpus_file(self) -> Path:
        return self.root / "corpus" / "passages.jsonl"

    @property
    def index_dir(self) -> Path:
        return self.root / "index"

    @property
    def document_kv_dir(self) -> Path:
        """The document KV store (TurboRAG): per-model namespaces inside (docs/turbo.md)."""
        return self.root / "document-kv"

    def store_file(self, tokenizer_fingerprint: str) -> Path:
        """The document store is tokenizer-specific: token IDs from another tokenizer are useless."""
        return self.root / "store" / f"passages-{tokenizer_fingerprint}.sqlite"
