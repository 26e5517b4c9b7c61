"""Benchmarks of the inference side (``specrag.pipeline``) and of pipelining over it.

Two kinds live here. Pipelining, the overlap of the search with the answer's prefill (run by
``specrag.controller``): ``python -m bench.pipeline``, the sweep of TTFT against the
search-to-prefill ratio (its command in ``__main__``, split into ``options``, ``calibration``,
``points``, ``analysis`` and ``report``; ``pgvector_point`` its point near r = 1 on a pgvector
table, also run alone), with ``ideal`` (its measured bounds), ``contention`` (search and
prefill slowing each other), ``abort`` (what a wrong speculation costs) and ``point_at_commit``
(one point measured by any commit's code). The engine alone, which ``specrag.pipeline`` holds and
whose prefill the overlap hides: ``prefill`` (cold against cached prefill, which sets the ratio),
``turbo`` (prefill from stored document KV, which shortens it) and ``startup`` (what an engine
start costs per compilation setting). They share the engine set-up and the family's place in
docs/, not the overlap; each keeps its command, ``python -m bench.pipeline.<name>``.
"""
