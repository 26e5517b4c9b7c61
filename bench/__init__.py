"""Benchmarks and the experiments behind every figure in docs/, one package per family.

Each family's main benchmark runs as ``python -m bench.<family>``, its other scripts as
``python -m bench.<family>.<script>``:

- ``bench.ordering``: prefix reuse of the document-ordering policies on simulated caches
  (``score``, the independent scorer; ``topic_traces``, traces shaped like RAG workloads);
- ``bench.quality``: answer quality of every configuration on the real model (``questions``);
- ``bench.retrieval``: recall of the indexes (``sets``, the evaluation sets) and ``search``, staged
  search's cost and stability;
- ``bench.faults``: the service under kills, hangs, overload, disconnects and bad input
  (``inputs``, the malformed-request catalogue the tests share);
- ``bench.pipeline``: TTFT against the search-to-prefill ratio (pipelining), ``contention``
  (search and prefill side by side), ``abort`` (what a wrong speculation costs); and the engine
  of the inference side alone: ``prefill`` (cold against cached), ``turbo`` (prefill from stored
  document KV), ``startup`` (what a start costs);
- ``bench.e2e``: the whole system on the real engine;
- ``bench.scale``: routers over many replicas.

``bench.common`` holds what every benchmark shares (output, machine facts, pinning and the
engine's processes, the run-and-report tail), ``bench.indexes`` the indexes several families
search (padded, on one thread) and ``bench.traces`` the document-ID traces and the one reader of
JSONL files.
"""
