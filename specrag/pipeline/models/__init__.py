"""Model directories: what one must hold and the manifest specrag writes (``directory``), the models
specrag makes by name offline (``catalog``: the GGUF default converted, ``random_model`` generated),
the digest of their weights, their tokenizer and chat format, and the dtype this machine runs them
in.

One room because these are files on disk that the engines load and the store tokenizes with;
nothing here starts an engine or knows of passages, so the model maker and the engine settings can
both depend on it. Import from the modules: some load torch or transformers.
"""

__all__: list[str] = []
