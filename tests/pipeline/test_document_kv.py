"""The document KV store: keys, atomic writes, unreadable entries, the byte bound and LRU eviction."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch

from specrag.errors import ArtifactError, InvalidInputError
from specrag.pipeline.document_kv import store as document_kv
from specrag.pipeline.document_kv.store import (
    DocumentKVStore,
    model_fingerprint,
    segment_key,
    store_namespace,
)
from specrag.pipeline.models import weights_digest
from specrag.pipeline.models.weights_digest import RECORD_NAME


def entry(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 2, 3, tokens, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def store(tmp_path: Path, max_bytes: int = 1 << 20) -> DocumentKVStore:
    return DocumentKVStore(tmp_path, store_namespace("abc123", torch.bfloat16, 32), max_bytes)


def test_keys_depend_on_tokens_and_spans() -> None:
    assert segment_key([1, 2, 3]) == segment_key((1, 2, 3))
    assert segment_key([1, 2, 3]) != segment_key([1, 2, 4])
    assert segment_key([1, 2, 3]) != segment_key([1, 2, 3], [[0, 2]])
    assert store_namespace("abc", torch.float32, 16) == "abc-float32-bs16"


def test_round_trip_and_missing(tmp_path: Path) -> None:
    kv_store = store(tmp_path)
    key = segment_key([5, 6, 7])
    assert kv_store.get(key) is None and not kv_store.contains(key)
    assert kv_store.put(key, entry(7))
    assert kv_store.contains(key)
    assert torch.equal(kv_store.get(key), entry(7))  # type: ignore[arg-type]


def test_a_failed_write_leaves_no_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The write is atomic: a crash mid-write leaves neither a partial entry nor a temporary file."""
    kv_store = store(tmp_path)
    key = segment_key([1])

    def crash(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        kv_store.put(key, entry(4))
    monkeypatch.undo()
    assert not kv_store.contains(key)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_an_unreadable_entry_reads_as_missing_and_goes(tmp_path: Path) -> None:
    kv_store = store(tmp_path)
    key = segment_key([9])
    kv_store.put(key, entry(3))
    kv_store.path(key).write_bytes(b"not safetensors")
    assert kv_store.get(key) is None
    assert not kv_store.contains(key)


def test_the_bound_evicts_least_recently_used(tmp_path: Path) -> None:
    size = len(document_kv_bytes(entry(16)))
    kv_store = store(tmp_path, max_bytes=3 * size)
    keys = [segment_key([i]) for i in range(4)]
    for age, key in enumerate(keys[:3]):
        kv_store.put(key, entry(16, age))
        os.utime(kv_store.path(key), (time.time() - 100 + age, time.time() - 100 + age))
    assert kv_store.get(keys[0]) is not None  # used now: the most recent
    kv_store.put(keys[3], entry(16, 3))
    assert [kv_store.contains(key) for key in keys] == [True, False, True, True]
    assert kv_store.total_bytes() <= kv_store.max_bytes


def test_an_entry_larger_than_the_bound_is_not_stored(tmp_path: Path) -> None:
    kv_store = store(tmp_path, max_bytes=100)
    assert not kv_store.put(segment_key([1]), entry(16))
    assert kv_store.total_bytes() == 0


def test_bad_input(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="positive"):
        DocumentKVStore(tmp_path, "ns", 0)
    with pytest.raises(InvalidInputError, match="namespace"):
        DocumentKVStore(tmp_path, "../up", 10)
    with pytest.raises(InvalidInputError, match="key"):
        store(tmp_path).path("../../etc")
    with pytest.raises(InvalidInputError, match="layers, 2"):
        store(tmp_path).put(segment_key([1]), torch.zeros(2, 3))


def test_model_fingerprint_follows_config_and_weights(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match=r"config\.json"):
        model_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ArtifactError, match="safetensors"):
        model_fingerprint(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes((8).to_bytes(8, "little") + b"{}      " + b"\0" * 64)
    first = model_fingerprint(tmp_path)
    weights.write_bytes((8).to_bytes(8, "little") + b"{}      " + b"\1" * 64)
    assert model_fingerprint(tmp_path) != first
    (tmp_path / "config.json").write_text('{"a": 1}')
    assert len({first, model_fingerprint(tmp_path)}) == 2


def document_kv_bytes(kv: torch.Tensor) -> bytes:
    """An entry as the store writes it (with its checksum)."""
    with tempfile.TemporaryDirectory() as scratch:
        kv_store = store(Path(scratch))
        kv_store.put(segment_key([0]), kv)
        return kv_store.path(segment_key([0])).read_bytes()


def test_a_flipped_byte_in_an_entry_never_reaches_a_prompt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """one flipped bit in an entry's tensor data is found by its checksum; the entry is
    dropped at WARNING (its caller recomputes it) rather than loaded as different KV."""
    kv_store = store(tmp_path)
    key = segment_key([4, 2])
    kv_store.put(key, entry(8))
    path = kv_store.path(key)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # inside the tensor data, not the header
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert kv_store.get(key) is None
    assert str(path) in caplog.text and "checksum" in caplog.text
    assert not kv_store.contains(key)


def test_an_entry_without_a_checksum_is_not_trusted(tmp_path: Path) -> None:
    """An entry written before checksums (or by anything else) is recomputed, not loaded."""
    from safetensors.torch import save

    kv_store = store(tmp_path)
    key = segment_key([7])
    kv_store.path(key).parent.mkdir(parents=True)
    kv_store.path(key).write_bytes(save({"kv": entry(3)}))
    assert kv_store.get(key) is None


def test_the_fingerprint_covers_the_whole_weights_and_the_vllm_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """a weight changed in the middle of a file (neither its header nor its last MiB)
    changes the key, and so does another vLLM; the digest is recorded once, beside the weights."""
    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    body = bytearray(3 << 20)
    weights.write_bytes((8).to_bytes(8, "little") + b"{}      " + bytes(body))
    first = model_fingerprint(tmp_path)
    assert (tmp_path / RECORD_NAME).is_file()
    assert model_fingerprint(tmp_path) == first
    body[1 << 20] = 1  # the same size, the same header and last MiB: only the whole digest sees it
    weights.write_bytes((8).to_bytes(8, "little") + b"{}      " + bytes(body))
    os.utime(weights, ns=(1, 1))  # a rewrite's new time, even within the clock's resolution
    second = model_fingerprint(tmp_path)
    assert second != first
    monkeypatch.setattr(document_kv, "vllm_version", lambda: "vllm 99.0")
    assert model_fingerprint(tmp_path) not in {first, second}


def test_a_recorded_weights_digest_is_read_not_recomputed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes((8).to_bytes(8, "little") + b"{}      " + b"\0" * 64)
    first = model_fingerprint(tmp_path)

    def no_hashing(path: Path) -> str:
        raise AssertionError(f"{path} hashed again")

    monkeypatch.setattr(weights_digest, "sha256_file", no_hashing)
    assert model_fingerprint(tmp_path) == first


def test_a_segment_after_a_prefix_has_its_own_key() -> None:
    assert segment_key([1, 2, 3], prefix=[9, 9]) != segment_key([1, 2, 3])
    assert segment_key([1, 2, 3], prefix=[9, 9]) != segment_key([1, 2, 3], prefix=[9, 8])
    assert segment_key([1, 2, 3], prefix=[9]) != segment_key([9, 1, 2, 3])


def test_an_entry_records_where_its_first_token_was_computed(tmp_path: Path) -> None:
    kv_store = store(tmp_path)
    key = segment_key([1, 2], prefix=[5] * 64)
    assert kv_store.put(key, entry(2), first_position=64)
    found = kv_store.entry(key)
    assert found is not None and found.first_position == 64 and torch.equal(found.kv, entry(2))
    with pytest.raises(InvalidInputError, match="first position"):
        kv_store.put(key, entry(2), first_position=-1)


def first_format_entry(kv: torch.Tensor) -> bytes:
    """An entry as stores wrote it before the format field: a checksum, no format, no position."""
    from safetensors.torch import save

    payload = document_kv._tensor_bytes(save({"kv": kv}))
    return save({"kv": kv}, metadata={document_kv._DIGEST_KEY: document_kv._digest(payload)})


def test_an_entry_of_the_first_format_loads_as_computed_alone(tmp_path: Path) -> None:
    kv_store = store(tmp_path)
    key = segment_key([3, 1])
    kv_store.path(key).parent.mkdir(parents=True)
    kv_store.path(key).write_bytes(first_format_entry(entry(4)))
    found = kv_store.entry(key)
    assert found is not None and found.first_position == 0 and torch.equal(found.kv, entry(4))


def test_an_entry_of_an_unknown_format_is_refused_and_said_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from safetensors.torch import save

    kv_store = store(tmp_path)
    key = segment_key([3, 2])
    kv = entry(4)
    payload = document_kv._tensor_bytes(save({"kv": kv}))
    metadata = {document_kv._DIGEST_KEY: document_kv._digest(payload), document_kv._FORMAT_KEY: "9"}
    kv_store.path(key).parent.mkdir(parents=True)
    kv_store.path(key).write_bytes(save({"kv": kv}, metadata=metadata))
    with caplog.at_level(logging.WARNING):
        assert kv_store.entry(key) is None
    assert "format '9' is not one this specrag reads" in caplog.text
