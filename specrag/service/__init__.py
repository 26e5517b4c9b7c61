"""The running service around the query core: HTTP server, assembly, engine pools (each engine
supervised and mirrored, by ``specrag.pipeline.engines`` and ``specrag.pipeline.kv_mirror``),
metrics, default assets, the ``serve``/``demo`` commands."""
