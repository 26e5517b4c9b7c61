"""The passages as the engine sees them: the document store (each passage tokenized once, as the
exact segment it becomes in a prompt, row-checksummed), its live layer (the change log, its
checkpoint at start) and the live corpus that writes store and index together, and the prompts
assembled from the stored segments as token IDs.

One room because a prompt is only as right as the rows it is built from: the row a document
version gets, the tokens stored for it and the layout the knowledge tree orders are one contract.
Import from the modules.
"""

__all__: list[str] = []
