"""specrag: faster RAG answers by overlapping staged vector search with prefix-cache-aware prefill.

Packages, one concern each (dependencies point one way, see DESIGN.md):

- ``specrag.retrieval``: corpus, document store, embedders, staged IVF/HNSW search.
- ``specrag.cache``: the knowledge tree that mirrors the engine's prefix cache, ordering, scheduling.
- ``specrag.pipeline``: prompts as token IDs, engine adapters (in-process vLLM, HTTP, simulated).
- ``specrag.controller``: speculation, adoption, admission, the aiohttp service and client.
"""

__version__ = "0.1.0"
