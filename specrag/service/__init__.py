"""The running service around the query core: HTTP server, assembly, engine supervisor, KV mirror,
metrics, default assets, the ``serve``/``demo`` commands."""
