"""How many answers a second specrag serves in front of GPU-pace engine stand-ins, beside a thin front."""
