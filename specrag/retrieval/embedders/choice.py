"""Which embedder embeds a backend's texts and questions, as ``--embedder`` and the flags that
say where a brought one is name it: checked when read, made only when a backend opens."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from specrag.errors import InvalidInputError
from specrag.retrieval.embedders.embedder import Embedder, SentenceTransformerEmbedder

__all__ = ["BROUGHT_EMBEDDERS", "EmbedderChoice"]

# Embedders a user brings: a model directory, or a server speaking OpenAI's /v1/embeddings.
BROUGHT_EMBEDDERS = ("sentence-transformers", "openai")


@dataclass(frozen=True)
class EmbedderChoice:
    """``--embedder`` and the flags that say where a brought one is, checked when read."""

    name: str
    model: str | None = None
    url: str | None = None
    key_env: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EmbedderChoice:
        choice = cls(args.embedder, args.embedder_model, args.embedder_url, args.embedder_key_env)
        if choice.name == "sentence-transformers" and not choice.model:
            raise InvalidInputError("--embedder sentence-transformers needs --embedder-model DIR")
        if choice.name == "openai" and (not choice.url or not choice.model):
            raise InvalidInputError("--embedder openai needs --embedder-url URL and --embedder-model NAME")
        return choice

    def brought(self) -> Embedder | None:
        """The brought embedder, made (None: a built-in one, which is fitted on the passages)."""
        if self.name == "sentence-transformers":
            assert self.model is not None, "checked by from_args"
            return SentenceTransformerEmbedder(Path(self.model))
        if self.name == "openai":
            assert self.url is not None and self.model is not None, "checked by from_args"
            from specrag.retrieval.embedders.http_embedder import OpenAIEmbedder

            return OpenAIEmbedder(self.url, self.model, api_key_env=self.key_env)
        return None
