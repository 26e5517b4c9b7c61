"""specrag: faster RAG answers by overlapping staged vector search with prefix-cache-aware prefill.

Packages, one concern each; imports point only down this list (docs/architecture.md, "Packages"):

- ``specrag.retrieval``: corpus, embedders, staged IVF/HNSW search.
- ``specrag.cache``: the knowledge tree that mirrors the engine's prefix cache, ordering, scheduling.
- ``specrag.pipeline``: the inference side, in rooms: engines (adapters, settings, supervisor),
  the KV mirror, models, the document store and prompts as token IDs, document KV.
- ``specrag.controller``: the query core: staged search, speculation, adoption, the prefill gate;
  the pipelining (search overlapped with prefill) is its.
- ``specrag.service``: the aiohttp service, its assembly, the engine pools, metrics.
- ``specrag.client``: the async client; imports nothing of the above.
- ``specrag.sim``: the simulated engine, its replicas and virtual time, for benchmarks and tests;
  nothing above imports it.
"""

__version__ = "0.1.0"

# The client is what most users import; load it (and aiohttp) only when asked, so that
# ``import specrag`` stays cheap and never pulls in the service side (vLLM, torch).
_CLIENT_NAMES = frozenset(
    {
        "AsyncClient",
        "ChatStream",
        "RagAnswer",
        "RagBatch",
        "RagStream",
        "SpecragConnectionError",
        "SpecragHTTPError",
        "SpecragTimeoutError",
    }
)
__all__ = ["__version__", *sorted(_CLIENT_NAMES)]


def __getattr__(name: str) -> object:
    if name in _CLIENT_NAMES:
        from specrag import client

        return getattr(client, name)
    raise AttributeError(f"module 'specrag' has no attribute {name!r}")
