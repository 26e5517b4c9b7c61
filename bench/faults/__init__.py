"""Reliability of the real service under faults (``python -m bench.faults``)."""
