"""The simulator beside the product: a simulated engine with vLLM's prefix-cache semantics,
replicas on it, and virtual time. Benchmarks (``bench.scale``) and tests import it; the product's
real path never does (tests/test_dependency_direction.py)."""
