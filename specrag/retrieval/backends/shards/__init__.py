"""A sharded index: N shards sharing one coarse quantizer, searched in stages, merged exactly.

merge: the staged searcher over shards (lock-step stages, merged running top-k) and which shard
owns a row; build: training the shared quantizer and filling the shards; store: the shard
directories and their checks; added: the rows added to a shard searched elsewhere, kept for its
restarts. docs/scale-out.md, "A sharded index", says how to build and serve one.
"""
