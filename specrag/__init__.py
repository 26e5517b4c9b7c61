"""specrag: faster RAG answers by overlapping staged vector search with prefix-cache-aware prefill.

Packages, one concern each (dependencies point one way, see DESIGN.md):

- ``specrag.retrieval``: corpus, document store, embedders, staged IVF/HNSW search.
- ``specrag.cache``: the knowledge tree that mirrors the engine's prefix cache, ordering, scheduling.
- ``specrag.pipeline``: prompts as token IDs, engine adapters (in-process vLLM, HTTP, simulated).
- ``specrag.controller``: speculation, adoption, admission, the aiohttp service and client.
"""

__version__ = "0.1.0"

# The client is what most users import; load it (and aiohttp) only when asked, so that
# ``import specrag`` stays cheap and never pulls in the service side (vLLM, torch).
_CLIENT_NAMES = frozenset(
    {
        "AsyncClient",
        "ChatStream",
        "RagAnswer",
        "RagStream",
        "SpecragConnectionError",
        "SpecragHTTPError",
        "SpecragTimeoutError",
    }
)
__all__ = ["__version__", *sorted(_CLIENT_NAMES)]


def __getattr__(name: str) -> object:
    if name in _CLIENT_NAMES:
        from specrag.controller import client

        return getattr(client, name)
    raise AttributeError(f"module 'specrag' has no attribute {name!r}")
