"""The exact KV mirror: the engine's KV-cache events (vLLM's ZMQ publisher and its replay socket)
followed into the knowledge tree, so the tree knows which blocks the engine holds.

``subscriber`` reads vLLM's sockets on a thread of its own; ``reassembly`` puts live and replayed
batches back in order there and drives the replays; ``sequence`` follows the publisher's numbers
and converts each event to the cache's plain event types (:mod:`specrag.cache.events`, which stay
in ``cache`` because the tree applies them); ``handoff`` applies the batches on the event loop a
bounded amount per turn; ``target`` is what a stream feeds and how far behind it is; ``mirror``
runs one subscription per engine and says whether the tree is exact or degraded, and why. Beside
the engines because it follows one engine's events; above nothing but the cache and the engine
settings. Import from the modules: ``subscriber``, ``reassembly`` and ``sequence`` load vLLM.
"""

__all__: list[str] = []
