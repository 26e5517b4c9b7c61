"""A GPU-pace stand-in for a vLLM server: what specrag uses of one, timed by a model, never a default.

One process per replica (``python -m specrag.sim.gpu_server``) speaks vLLM's OpenAI completions
with token-ID prompts, its ``/metrics`` and prefix-cache reset, and publishes vLLM's own KV-event
classes, hashed with vLLM's own block hashing, over a least-recently-used prefix cache; its steps
take the time a :class:`~specrag.sim.gpu_server.time_model.TimeModel` says (by default an 8B model
on one H100, docs/capacity.md). It measures specrag's own work at GPU pace, where the engine is no
longer the slow part; it is never evidence for a model's latency.
"""
