"""Questions embedded by an OpenAI-compatible embedding server instead of in this process.

An index's manifest records the embedder that embedded its passages (``minilm`` with the
checksum of its weights, or ``openai`` with the served model's name). A server may embed the
questions of such an index only if it serves that same model: MiniLM under one of the names
servers give it (:data:`MINILM_SERVED_NAMES`), or the recorded server model by its name, and in
either case the recorded dimension. A server cannot prove which weights it runs: the name and
the dimension are what its API says, and the documents log re-embeds one logged document at
start and refuses vectors that disagree (:mod:`specrag.pipeline.store.live_checkpoint`), which
catches a server that answers to the name with other weights. Embedders fitted on the corpus
(WordLlama with IDF pooling, TF-IDF) exist only in the index: no server serves them.

:class:`ServedEmbedder` then replaces the index's own embedder: every question, and every
document the documents API adds, is embedded by the server, under the recorded kind so that the
documents log written before (by the in-process embedder) is checked against it, not refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from specrag.retrieval.embedders.http_embedder import OpenAIEmbedder

__all__ = ["MINILM_SERVED_NAMES", "ServedEmbedder", "served_mismatch"]

# all-MiniLM-L6-v2 (specrag's default embedder, ``minilm`` in a manifest) by the names an
# embedding server is started with: the Hugging Face repository and its short form.
MINILM_SERVED_NAMES = ("sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2")
_MINILM_KIND = "minilm"


def served_mismatch(recorded: Mapping[str, Any] | None, server: OpenAIEmbedder) -> str | None:
    """Why ``server`` may not embed the questions of an index whose manifest records the
    embedder ``recorded`` (None: no index yet, which the server will embed), or None."""
    if recorded is None:
        return None
    kind, dim = recorded.get("kind"), recorded.get("dim")
    served = f"the embedding server {server.url} serves {server.model!r} ({server.dim} dimensions)"
    if kind == _MINILM_KIND:
        names: tuple[str, ...] = MINILM_SERVED_NAMES
    elif kind == OpenAIEmbedder.kind:
        names = (str(recorded.get("model")),)
    else:
        return (
            f"the index was embedded by {kind}, fitted on its passages, which no server serves: serve it "
            f"with --embedder {kind}, or rebuild it with `specrag prepare --embedder minilm`"
        )
    if server.model not in names or server.dim != dim:
        return (
            f"the index was embedded by {kind} model {' or '.join(map(repr, names))} ({dim} dimensions), "
            f"{served}: start the server with that model, or rebuild the index"
        )
    return None


class ServedEmbedder:
    """The index's embedder as served: vectors from ``server``, kind and manifest entry the index's."""

    def __init__(self, server: OpenAIEmbedder, recorded: Mapping[str, Any]) -> None:
        self.server = server
        self.kind = str(recorded.get("kind"))
        self._recorded = dict(recorded)

    @property
    def dim(self) -> int:
        return self.server.dim

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self.server.embed(texts)

    async def embed_async(self, texts: Sequence[str]) -> np.ndarray:
        return await self.server.embed_async(texts)

    def save(self, directory: Path) -> dict[str, Any]:
        """The index's own entry: the server stands in for the embedder that entry names."""
        return dict(self._recorded)
