"""The lexical channel: BM25 over stemmed words, the code identifiers a question names, fusion."""
