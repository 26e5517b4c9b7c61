"""Retrieval quality of the indexes (``python -m bench.retrieval``), staged search
(``python -m bench.retrieval.search``) and follow-up questions
(``python -m bench.retrieval.conversations``)."""
