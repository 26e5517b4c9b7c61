"""faiss IVF and HNSW searched in stages on this machine: their kernels and running top-k."""
