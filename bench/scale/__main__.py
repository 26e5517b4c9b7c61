"""``python -m bench.scale [--quick]``: the routers compared (:mod:`bench.scale.routers`)."""

from bench.scale.routers import main

if __name__ == "__main__":
    main()
