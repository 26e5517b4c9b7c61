"""Retrieval: corpus, embedders and staged vector search. Knows nothing of LLMs."""
