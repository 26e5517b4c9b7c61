"""The inference side: the engines that prefill and decode, the models they load, the passages and
prompts they are given as token IDs, the document KV they may reuse, and the mirror of their prefix
cache.

Its rooms: ``engines/`` (the one ``Engine`` protocol and its adapters: in-process vLLM, an
OpenAI-compatible server over HTTP, Ray replicas; the engine settings; the supervisor that keeps
one alive), ``kv_mirror/`` (the engine's KV-cache events followed into the knowledge tree),
``models/`` (model directories: the catalog, GGUF conversion, the generated random model, weights
digest, tokenizer, chat format, dtype), ``store/`` (the passage store, the live corpus and its log,
prompts assembled from token segments) and ``document_kv/`` (TurboRAG's per-document KV store, its
RoPE rotation and vLLM connector). ``commands`` registers ``make-model`` and ``engine``.

"Pipeline" names the inference pipeline, not pipelining: the overlap of the staged search with the
answer's prefill, and when to speculate, are the controller's (``specrag.controller``).
"""
