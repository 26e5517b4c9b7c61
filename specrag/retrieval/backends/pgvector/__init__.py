"""PostgreSQL + pgvector as a staged retrieval backend (docs/backends.md).

config: where the table is, its columns, the settings of a build and of a served table, saying
where without the password; database: the bounded pool and its errors; deadline: the client's
bound on every call; table: loading a corpus and checking a table; searcher: staged search by
nested IVFFlat probes in one snapshot (queries: a stage's statements and top-k; parallel: the
two-connection mode; rows: the service's names for the table's rows); changes and writes: other
writers' rows and the documents API's; backend: what the registry registers (settings from the
flags, load, open); assembly: loading a table and opening one for serving, with its /health
part; local_server: a throwaway server for tests and benchmarks. The driver is imported only
when ``--backend pgvector`` builds or serves a table.
"""
