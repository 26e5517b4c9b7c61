"""Retrieval quality of the indexes (``python -m bench.retrieval``) and staged search
(``python -m bench.retrieval.search``)."""
