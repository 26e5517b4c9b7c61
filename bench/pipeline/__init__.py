"""Speculative pipelining and the prefill it overlaps (``python -m bench.pipeline``)."""
