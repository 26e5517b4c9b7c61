"""Which embedder embeds a backend's texts and questions, as ``--embedder`` and the flags that
say where a brought one is name it: checked when read, made only when a backend opens."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specrag.errors import InvalidInputError
from specrag.retrieval.embedders.embedder import Embedder, SentenceTransformerEmbedder

if TYPE_CHECKING:  # aiohttp's client is imported only for a server
    from specrag.retrieval.embedders.http_embedder import OpenAIEmbedder

__all__ = [
    "BROUGHT_EMBEDDERS",
    "DEFAULT_EMBEDDER_TIMEOUT_S",
    "SERVED_EMBEDDER",
    "EmbedderChoice",
    "add_brought_arguments",
]

# A server speaking OpenAI's /v1/embeddings (serve may embed any index's questions with it).
SERVED_EMBEDDER = "openai"
# Embedders a user brings: a model directory, or such a server.
BROUGHT_EMBEDDERS = ("sentence-transformers", SERVED_EMBEDDER)
# Seconds an embedding server may take to embed a question (serve's --embedder-timeout): a GPU
# server's are milliseconds; an index build's calls keep the client's own, longer bound.
DEFAULT_EMBEDDER_TIMEOUT_S = 5.0


def add_brought_arguments(parser: argparse._ActionsContainer) -> None:
    """The flags that say where a brought embedder is (``index build``'s and ``serve``'s alike),
    read by :meth:`EmbedderChoice.from_args`."""
    parser.add_argument("--embedder-model", help="model directory, or the model name a server serves")
    parser.add_argument("--embedder-url", help="base URL of an OpenAI-compatible /v1/embeddings server")
    parser.add_argument("--embedder-key-env", help="environment variable holding the server's API key")


@dataclass(frozen=True)
class EmbedderChoice:
    """``--embedder`` and the flags that say where a brought one is, checked when read."""

    name: str
    model: str | None = None
    url: str | None = None
    key_env: str | None = None
    timeout_s: float | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EmbedderChoice:
        timeout_s = vars(args).get("embedder_timeout")  # serve's flag; index build has none
        choice = cls(args.embedder, args.embedder_model, args.embedder_url, args.embedder_key_env, timeout_s)
        if timeout_s is not None and not timeout_s > 0:
            raise InvalidInputError(
                f"--embedder-timeout must be a positive number of seconds, got {timeout_s}"
            )
        if choice.name == "sentence-transformers" and not choice.model:
            raise InvalidInputError("--embedder sentence-transformers needs --embedder-model DIR")
        if choice.name == SERVED_EMBEDDER and (not choice.url or not choice.model):
            raise InvalidInputError("--embedder openai needs --embedder-url URL and --embedder-model NAME")
        return choice

    def brought(self) -> Embedder | None:
        """The brought embedder, made (None: a built-in one, which is fitted on the passages)."""
        if self.name == "sentence-transformers":
            assert self.model is not None, "checked by from_args"
            return SentenceTransformerEmbedder(Path(self.model))
        if self.name == SERVED_EMBEDDER:
            return self.served()
        return None

    def served(self) -> OpenAIEmbedder:
        """The embedding server named, each call bounded by ``timeout_s`` (else the client's
        own bound). It is asked for its dimension now: an unreachable server fails the command,
        not its first question."""
        assert self.url is not None and self.model is not None, "checked by from_args"
        from specrag.retrieval.embedders.http_embedder import DEFAULT_TIMEOUT_S, OpenAIEmbedder

        return OpenAIEmbedder(
            self.url, self.model, timeout_s=self.timeout_s or DEFAULT_TIMEOUT_S, api_key_env=self.key_env
        )
