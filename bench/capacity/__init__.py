"""Capacity benchmarks: how much load specrag's own control plane holds in front of fast engines."""
