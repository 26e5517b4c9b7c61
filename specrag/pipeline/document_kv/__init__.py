"""Document KV, TurboRAG-style: each prompt segment's keys and values computed alone and stored on
disk (``store``), rotated to their positions in a prompt (``rope``) and handed to an unmodified
vLLM through its public KV-connector API (``connector``, which vLLM loads by module path).

One room because the three share one key (the segment's tokens, the model's weights digest) and
one layout; the engine and the live store reach in only to switch it on and to purge retired
segments. Import from the modules: they load torch and vLLM.
"""

__all__: list[str] = []
