"""Retrieval: corpus, document store, embedders and staged vector search. Knows nothing of LLMs."""
