"""End-to-end latency experiments (``python -m bench.e2e``)."""
