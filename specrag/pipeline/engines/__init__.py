"""The engines: the one async protocol the controller speaks (``protocol``), the bookkeeping every
adapter shares (``base``), the adapters (in-process vLLM with its scheduler readings, an
OpenAI-compatible server over HTTP, vLLM replicas on Ray), their settings (``config``) and the
supervisor that replaces a dead or hung engine behind the same protocol.

They sit together because an adapter is the protocol plus one way to reach an engine, and the
supervisor is one more engine wrapping another; they load models and document KV but know nothing
of passages, prompts or the knowledge tree. Import from the modules: this package loads nothing,
so that asking for the protocol never starts importing vLLM.
"""

__all__: list[str] = []
