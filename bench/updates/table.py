"""What the documents of bench.updates carry instead of an embedding model and a tokenizer: each
one's vector in a table, one stand-in token; so the figures are the log's and the index's."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


class TableEmbedder:
    """The vector a document carries: its text is ``vec:<n>``, row n of the table."""

    kind = "table"

    def __init__(self, table: np.ndarray) -> None:
        self.table = table

    @property
    def dim(self) -> int:
        return int(self.table.shape[1])

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self.table[[int(text.rsplit(":", 1)[1]) for text in texts]]

    def save(self, directory: Path) -> dict[str, Any]:
        raise NotImplementedError("a benchmark's table embedder is never saved")


def stand_in_tokens(texts: list[str]) -> list[list[int]]:
    """One token a document: the store keeps tokens, the benchmark does not measure a tokenizer."""
    return [[len(text)] for text in texts]
