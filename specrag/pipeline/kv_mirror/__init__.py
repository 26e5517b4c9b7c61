"""The exact KV mirror: the engine's KV-cache events (vLLM's ZMQ publisher and its replay socket)
followed into the knowledge tree, so the tree knows which blocks the engine holds.

``subscriber`` reads vLLM's wire format, orders batches by sequence number, fills gaps from the
replay socket and converts each event to the cache's plain event types
(:mod:`specrag.cache.events`, which stay in ``cache`` because the tree applies them); ``mirror``
runs one subscription per engine and says whether the tree is exact or degraded, and why. Beside
the engines because it follows one engine's events; above nothing but the cache and the engine
settings. Import from the modules: the subscriber loads vLLM.
"""

__all__: list[str] = []
