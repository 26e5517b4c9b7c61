"""Prefix reuse of the document-ordering policies (``python -m bench.ordering``)."""
