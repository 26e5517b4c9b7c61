"""Answer quality of every configuration (``python -m bench.quality``)."""
