"""The large libraries a start needs, imported once, on one thread, before its threads run side by side.

``serve`` starts the engine while a thread checks the artefacts (:func:`~specrag.service.run.
assets.check_assets_in_background`), and both sides import the same large libraries on first use:
the tokenizer and MiniLM import transformers (with torch, and accelerate through its modelling
code), vLLM's start imports all of them too, and the event loop imports torch for the engine's
module. Python locks each module while it runs, but two threads that import one package graph in
different orders can each hold a module the other waits for; Python then breaks the cycle by
handing one of them a module still half run, and an import fails (``cannot import name
'dispatch_model' from partially initialized module 'accelerate.big_modeling'``: one ``serve`` in
about fifteen crashed so). So the ``imports`` phase imports every large package either side
imports, on one thread, before the two start (:func:`import_for_start`); afterwards each side
imports only small modules of its own. The work is the same either way (the imports were
interleaved under the GIL, not parallel), only in one place.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable

from specrag.retrieval.index_store import MINILM, WORDLLAMA

__all__ = ["Importer", "import_for_start", "start_imports"]

logger = logging.getLogger(__name__)

# One import of the list: a module (and names in it), or a package's own way in.
Importer = Callable[[], object]


def _module(name: str, *attributes: str) -> Importer:
    """Import ``name`` and look its ``attributes`` up: transformers loads a class's module on the
    name's first use, so naming it imports that module here rather than on a racing thread."""

    def load() -> object:
        module = importlib.import_module(name)
        for attribute in attributes:
            getattr(module, attribute)
        return module

    load.__qualname__ = load.__name__ = f"import {name}"
    return load


def _wordllama() -> object:
    if importlib.util.find_spec("wordllama") is None:
        return None  # not installed: the embedder says so if the index needs it
    from specrag.retrieval.embedders.wordllama_embedder import import_wordllama

    return import_wordllama()  # the package's import configures logging: this one puts it back


# What the artefact checks import: the tokenizer (transformers' auto classes, the fast tokenizer,
# the default model's configuration: SmolLM2 is a Llama; both sides read it) and the modelling
# code MiniLM's encoder is built from (which imports accelerate when installed).
_ARTEFACTS = (
    _module("torch"),
    _module("transformers", "AutoConfig", "AutoTokenizer", "PreTrainedTokenizerFast", "LlamaConfig"),
    _module("transformers.modeling_utils"),
    _module("tokenizers"),
    _module("safetensors.torch"),
    _module("specrag.retrieval.backends.local.staged_hnsw"),  # numba's kernels
)
# Each built-in query embedder's own libraries (the index names the one it was built with).
_EMBEDDERS: dict[str, tuple[Importer, ...]] = {
    MINILM: (_module("transformers", "BertConfig", "BertModel"),),
    WORDLLAMA: (_wordllama,),
}
# What the in-process engine's start imports in this process before it spawns vLLM's own: the
# engine's module (torch), vLLM's engine, its arguments, configuration and platform.
_IN_PROCESS_ENGINE = (
    _module("specrag.pipeline.engines.vllm_engine"),
    _module("vllm.v1.engine.async_llm", "AsyncLLM"),
    _module("vllm.engine.arg_utils", "AsyncEngineArgs"),
    _module("vllm.config", "KVEventsConfig", "KVTransferConfig"),
    _module("vllm.platforms", "current_platform"),
)


def start_imports(*, in_process_engine: bool, embedder: str | None) -> tuple[Importer, ...]:
    """What a start imports: the artefact checks' libraries, ``embedder``'s (for None or another
    embedder, all the built-in ones': the index may name either), and with ``in_process_engine``
    vLLM's."""
    chosen = _EMBEDDERS.get(embedder or "") or tuple(item for items in _EMBEDDERS.values() for item in items)
    return (*_ARTEFACTS, *chosen, *(_IN_PROCESS_ENGINE if in_process_engine else ()))


def import_for_start(imports: tuple[Importer, ...]) -> None:
    """Run ``imports`` on this thread. A package that is not installed is skipped: the code that
    needs it says what to install when it runs (an ``--engine-url`` service has no vLLM)."""
    for load in imports:
        try:
            load()
        except (ImportError, AttributeError) as error:  # AttributeError: a name an older version lacks
            logger.debug("start-up imports: %s skipped (%s)", load.__qualname__, error)
