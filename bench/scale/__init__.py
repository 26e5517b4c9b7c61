"""Scale-out benchmarks: the routers over many replicas (``python -m bench.scale``, in
:mod:`bench.scale.routers`) and the sharded index on Ray (``python -m bench.scale.shards``)."""
