"""The index facade's parts, behind ``vector_index.VectorIndex``: the searcher as its declared
capabilities open it, the row → passage mapping with its live changes, and the hybrid channel."""
