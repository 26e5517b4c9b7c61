"""How many answers a second specrag serves in front of GPU-pace engine stand-ins, beside a thin front,
and where its own CPU per answer goes (``bench.capacity.profile``)."""
