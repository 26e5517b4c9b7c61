"""TurboRAG on an unmodified vLLM: a v1 KV connector that loads documents' stored KV.

vLLM loads this module itself (``kv_connector_module_path``), once in its scheduler and once in
its model worker (separate processes); they share only the document KV store's directory.

Scheduler side: a request whose ``kv_transfer_params`` name its document spans (``{"specrag_turbo":
{"segments": [[start, end], ...], "prefix": p}}``; ``prefix``, when there, says the documents after
the first ``p`` tokens were stored as computed after those tokens) is offered, beyond vLLM's own
prefix-cache hit, every token up to the end of its last span, provided each span from the hit on is
in the store and they leave no gap. vLLM then prefills only what follows (the question). A request
marked ``{"specrag_turbo": {"save": true}}`` (a segment prefilled alone, see
:meth:`specrag.pipeline.engines.vllm_engine.VllmEngine.fill_document_kv`) has its whole prompt's KV
saved (with spans too: a turbo prompt's KV as loaded and computed, for checking the load); with
``"save_from": p`` only the tokens from ``p`` on, keyed as computed after the first ``p``.

Worker side: before the forward pass of the step that admits a request, each claimed span's stored
KV is written into the request's blocks with the keys rotated from their stored positions (from the
entry's recorded first position on) to their prompt positions
(:mod:`specrag.pipeline.document_kv.rope`), using the attention backend's own cache-write op, so the
backend's internal block layout (the CPU backend stores keys transposed per block, and packs them
differently per instruction set) never has to be known for writing. Saving must read that layout:
:class:`BlockLayout` learns it by writing coded keys through the same op. An entry that vanished
between claim and load (evicted) is reported as a load error; vLLM then recomputes those blocks
(``kv_load_failure_policy="recompute"``).

The blocks a turbo request fills are approximations of a full prefill (each document saw only
itself, or the prefix), so turbo requests run under their own prefix-cache salts: a full-prefill
request never reuses them (:attr:`specrag.pipeline.engines.protocol.Sampling.cache_salt`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm import _custom_ops as ops
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from specrag.errors import ArtifactError
from specrag.pipeline.document_kv.rope import RopeSpec
from specrag.pipeline.document_kv.store import (
    LOADED_KEY,
    PARAMS_KEY,
    DocumentKVStore,
    segment_key,
    span_key,
    store_namespace,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["BlockLayout", "Transfer", "TurboConnector", "TurboMetadata", "claim_plan"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Transfer:
    """Tokens ``[first, first + len(slots))`` of a stored segment whose token 0 sits at prompt
    position ``position``, to or from these KV slots."""

    key: str
    first: int
    position: int
    slots: tuple[int, ...]


@dataclass
class TurboMetadata(KVConnectorMetadata):
    """One step's work for the worker: spans to load before the forward, prompts to save after."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


def _slots(block_ids: list[int], block_size: int, start: int, stop: int) -> tuple[int, ...]:
    return tuple(block_ids[p // block_size] * block_size + p % block_size for p in range(start, stop))


def claim_plan(
    tokens: list[int], segments: list[list[int]], computed: int, contains: Any, prefix: int = 0
) -> list[tuple[str, int, int]] | None:
    """The stored segments ``(key, start, end)`` that cover ``[computed, end of the last)``, or None.

    None when anything is missing: a span not in the store, a gap between spans (a hint is not
    stored), spans out of order, nothing left to claim, or no token left for vLLM to compute
    (it must compute at least the last prompt token to sample from). ``prefix``: see
    :func:`span_key`.
    """
    if not segments:
        return None
    end = segments[-1][1]
    if computed >= end or end >= len(tokens):
        return None
    plan = []
    cursor = computed
    for start, stop in segments:
        if not 0 <= start < stop:
            return None
        if stop <= computed:
            continue
        if start > cursor:
            return None
        key = span_key(tokens, start, stop, prefix)
        if not contains(key):
            return None
        plan.append((key, start, stop))
        cursor = stop
    return plan


class BlockLayout:
    """Where the attention backend keeps token ``t``'s key and value element ``d`` inside a block.

    Learned by writing two coded blocks through the backend's own write op (one coding token
    offsets, one coding dimensions: small integers, exact even in bfloat16), so any layout the op
    uses (transposed, packed per instruction set) is read back correctly.
    """

    def __init__(self, dtype: torch.dtype, block_size: int, head_dim: int, isa: str) -> None:
        self.block_size, self.head_dim = block_size, head_dim
        codes = []
        for coded in ("token", "dim"):
            cache = torch.zeros(1, 1, block_size, 2 * head_dim, dtype=dtype)
            key_cache, value_cache = cache.view(1, 1, 2 * block_size, head_dim).chunk(2, dim=2)
            grid = torch.arange(block_size if coded == "token" else head_dim, dtype=torch.float32) + 1
            values = (
                grid[:, None].expand(block_size, head_dim)
                if coded == "token"
                else grid.expand(block_size, head_dim)
            )
            entry = values[:, None, :].to(dtype).contiguous()
            ops.cpu_attn_reshape_and_cache(
                entry, entry.clone(), key_cache, value_cache, torch.arange(block_size), isa
            )
            codes.append(cache.reshape(-1).to(torch.int64) - 1)
        token, dim = codes
        region = block_size * head_dim
        index = torch.full((2 * region,), -1, dtype=torch.int64)
        flat = torch.arange(2 * region)
        kind = (flat >= region).to(torch.int64)
        target = kind * region + token * head_dim + dim
        valid = (token >= 0) & (token < block_size) & (dim >= 0) & (dim < head_dim)
        if not bool(valid.all()):
            raise ArtifactError(f"the attention backend's KV block layout ({isa}) is not a permutation")
        index[target] = flat
        if bool((index < 0).any()):
            raise ArtifactError(f"the attention backend's KV block layout ({isa}) is not a permutation")
        self.index = index.view(2, block_size, head_dim)  # [k/v, offset, dim] -> position in block

    def read(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Keys and values of ``slots`` from one layer's cache, as ``[2, heads, tokens, head_dim]``."""
        blocks, heads = kv_cache.shape[0], kv_cache.shape[1]
        rows = kv_cache.view(blocks, heads, -1)[slots // self.block_size]  # [n, heads, block]
        where = self.index[:, slots % self.block_size, :].permute(1, 0, 2).reshape(len(slots), 1, -1)
        picked = torch.gather(rows, 2, where.expand(-1, heads, -1))
        return picked.view(len(slots), heads, 2, self.head_dim).permute(2, 1, 0, 3)


class TurboConnector(KVConnectorBase_V1):
    """The connector vLLM instantiates; its settings come from ``kv_connector_extra_config``:
    ``store_dir``, ``max_bytes`` and ``model_fingerprint``."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._block_size = int(vllm_config.cache_config.block_size)
        dtype = vllm_config.model_config.dtype
        if not isinstance(dtype, torch.dtype):  # vLLM resolves "auto" while building its config
            raise ArtifactError(f"vLLM's model dtype is unresolved: {dtype!r}")
        self._store = DocumentKVStore(
            Path(extra["store_dir"]),
            store_namespace(str(extra["model_fingerprint"]), dtype, self._block_size),
            int(extra["max_bytes"]),
        )
        self._rope = RopeSpec.from_config(vllm_config.model_config.hf_config.to_dict())
        # Scheduler side.
        self._loads: dict[str, tuple[Request, list[tuple[str, int, int]], int]] = {}
        self._saves: dict[str, tuple[Request, str, int]] = {}  # request, key, first token saved
        self._loaded: dict[str, int] = {}  # tokens claimed per request, told when it finishes
        # Worker side.
        self._caches: dict[str, torch.Tensor] = {}
        self._layout: BlockLayout | None = None
        self._failed_blocks: set[int] = set()

    # ----------------------------------------------------------------------------- scheduler side

    @staticmethod
    def _params(request: Request) -> dict[str, Any]:
        params = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        return params if isinstance(params, dict) else {}

    def _plan(self, request: Request, computed: int) -> list[tuple[str, int, int]] | None:
        params = self._params(request)
        segments = params.get("segments") or []
        tokens = list(request.prompt_token_ids or [])
        return claim_plan(tokens, segments, computed, self._store.contains, int(params.get("prefix", 0)))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        plan = self._plan(request, num_computed_tokens)
        if plan is None:
            return 0, False
        return plan[-1][2] - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = self._params(request)
        if params.get("save"):
            tokens = list(request.prompt_token_ids or [])
            start = int(params.get("save_from", 0))
            key = segment_key(tokens[start:], params.get("segments") or (), prefix=tokens[:start])
            self._saves[request.request_id] = (request, key, start)
        if num_external_tokens <= 0:
            return
        end = params["segments"][-1][1]
        start = end - num_external_tokens
        plan = self._plan(request, start)
        if plan is not None:
            self._loads[request.request_id] = (request, plan, start)
            self._loaded[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TurboMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        assert self._kv_cache_manager is not None
        for request_id in [r for r in self._loads if r in scheduled]:
            _, plan, start = self._loads.pop(request_id)
            block_ids = self._kv_cache_manager.get_block_ids(request_id)[0]
            for key, seg_start, seg_end in plan:
                first = max(seg_start, start)
                meta.loads.append(
                    Transfer(
                        key, first - seg_start, seg_start, _slots(block_ids, self._block_size, first, seg_end)
                    )
                )
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for request_id in [r for r in self._saves if r in scheduled]:
            request, key, save_from = self._saves[request_id]
            length = len(request.prompt_token_ids or [])
            if computed.get(request_id, 0) + scheduled[request_id] < length:
                continue  # a later chunk completes the prompt
            del self._saves[request_id]
            block_ids = self._kv_cache_manager.get_block_ids(request_id)[0]
            slots = _slots(block_ids, self._block_size, save_from, length)
            meta.saves.append(Transfer(key, 0, save_from, slots))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._loads.pop(request.request_id, None)
        self._saves.pop(request.request_id, None)
        if PARAMS_KEY not in (request.kv_transfer_params or {}):
            return False, None
        return False, {LOADED_KEY: self._loaded.pop(request.request_id, 0)}

    # -------------------------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = dict(kv_caches)

    def _isa(self, layer_name: str) -> str:
        layer = self._vllm_config.compilation_config.static_forward_context[layer_name]
        return str(layer.isa)

    def _block_layout(self) -> BlockLayout:
        if self._layout is None:
            name, cache = next(iter(self._caches.items()))
            self._layout = BlockLayout(cache.dtype, cache.shape[2], cache.shape[3] // 2, self._isa(name))
        return self._layout

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TurboMetadata)
        for transfer in meta.loads:
            entry = self._store.entry(transfer.key)
            count = len(transfer.slots)
            if (
                entry is None
                or entry.kv.shape[0] != len(self._caches)
                or entry.kv.shape[3] < transfer.first + count
            ):
                logger.warning("document KV %s missing or mismatched: recomputing its blocks", transfer.key)
                self._failed_blocks.update(slot // self._block_size for slot in transfer.slots)
                continue
            span = entry.kv[:, :, :, transfer.first : transfer.first + count]
            shift = transfer.position - entry.first_position
            keys = self._rope.shift(span[:, 0], shift)  # [layers, heads, n, dim]
            slots = torch.tensor(transfer.slots, dtype=torch.int64)
            for index, (name, cache) in enumerate(self._caches.items()):
                blocks, heads, block_size, _ = cache.shape
                key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
                ops.cpu_attn_reshape_and_cache(
                    keys[index].transpose(0, 1).to(cache.dtype).contiguous(),
                    span[index, 1].transpose(0, 1).to(cache.dtype).contiguous(),
                    key_cache,
                    value_cache,
                    slots,
                    self._isa(name),
                )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are synchronous: start_load_kv finished them before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return None  # saved once per step, from every layer, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TurboMetadata)
        for transfer in meta.saves:
            slots = torch.tensor(transfer.slots, dtype=torch.int64)
            layout = self._block_layout()
            kv = torch.stack([layout.read(cache, slots) for cache in self._caches.values()])
            self._store.put(transfer.key, kv, first_position=transfer.position)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed
