"""PostgreSQL + pgvector as a staged retrieval backend (docs/backends.md).

config: where the table is, its columns, saying where without the password; database: the
bounded pool and its errors; table: loading a corpus and checking a table; searcher: staged
search by nested IVFFlat probes in one snapshot; assembly: from flags to an index;
local_server: a throwaway server for tests and benchmarks. Imported only with
``--backend pgvector``, so the driver is needed only there.
"""
