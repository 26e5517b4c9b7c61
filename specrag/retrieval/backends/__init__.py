"""Where each backend's staged searcher lives: faiss on local files, PostgreSQL + pgvector, shards."""
