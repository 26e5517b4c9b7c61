"""Everything that shapes a service besides its assets, checked before any engine starts.

Errors name ``specrag serve``'s flags: the options are what the command line said.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specrag.controller.config import ControllerConfig
from specrag.controller.modes import DocumentKv
from specrag.controller.placement import Router
from specrag.errors import InvalidInputError, check_choice
from specrag.pipeline.engines.config import EngineConfig, KVEventSource, parse_cpus
from specrag.pipeline.engines.supervisor import SupervisorPolicy
from specrag.pipeline.models.directory import model_context_length
from specrag.service.http.access import Access
from specrag.service.http.in_flight import check_query_limits

__all__ = ["DocumentKvStore", "ServiceOptions", "base_engine_config", "default_context_length"]


class DocumentKvStore(enum.StrEnum):
    """``serve --document-kv``: whether the in-process engine loads documents' stored KV (TurboRAG)."""

    OFF = "off"
    TURBO = "turbo"

    @property
    def request_default(self) -> DocumentKv:
        """The document KV of a request that names none: what the engine can do."""
        return DocumentKv.TURBO if self is DocumentKvStore.TURBO else DocumentKv.FULL


@dataclass(frozen=True)
class ServiceOptions:
    """Everything that shapes a service besides the assets."""

    controller: ControllerConfig = field(default_factory=ControllerConfig)
    # Separate engine servers (one makes the service's engine, several a pool), and where each
    # publishes its KV events (none, or one per URL in the same order).
    engine_urls: tuple[str, ...] = ()
    engine_kv_events: tuple[str, ...] = ()
    eager: bool = False
    # Cores of the in-process engine (vLLM's OMP_THREADS_BIND form, "0" or "0-1"), and of this
    # process with its vector search: see specrag.service.run.pinning. None leaves them where they are.
    engine_cpus: str | None = None
    search_cpus: str | None = None
    # Who may come in (tokens, writers, how clients are told apart) and how many queries at once.
    access: Access = field(default_factory=Access)
    supervisor: SupervisorPolicy = field(default_factory=SupervisorPolicy)
    # Ray: None for no Ray, "" for a local instance (or $RAY_ADDRESS), else a cluster's address.
    ray_address: str | None = None
    # In-process engines (or Ray replicas with ``ray_address``).
    replicas: int = 1
    # A sharded index searched by one Ray actor per shard (its shard count, checked against the
    # index at start), which loads its files from ``index_dir``: None searches in this process.
    # What a command line may combine with them is the shards backend's to say
    # (specrag.retrieval.backends.registry: --ray, a positive count, --search-shard-cpus).
    search_shards: int | None = None
    index_dir: str | None = None
    # The CPUs each shard actor asks Ray for (a share of a core allowed); None: what the cluster
    # has left beside the engine replicas (specrag.service.run.sharded_serving.shard_cpus).
    search_shard_cpus: float | None = None
    router: Router | str = Router.SPECRAG
    # TurboRAG: the document KV store's directory; None keeps it off (see docs/turbo.md).
    document_kv_dir: str | None = None
    document_kv_max_gib: float = EngineConfig.document_kv_max_gib
    # The in-process engines' prefix cache in tokens (None: what --kv-cache-gib holds).
    kv_cache_tokens: int | None = None

    def __post_init__(self) -> None:
        """Bad combinations fail here, before any engine starts (flag names: ``specrag serve``'s)."""
        object.__setattr__(self, "router", check_choice("--router", self.router, Router))
        if self.replicas < 1:
            raise InvalidInputError(f"--replicas must be at least 1, got {self.replicas}")
        check_query_limits(
            self.access.max_queries,
            self.access.max_queries_per_client,
            ("--max-queries", "--max-queries-per-client"),
        )
        if self.engine_urls and self.ray_address is not None:
            raise InvalidInputError("--ray and --engine-url exclude each other (Ray starts its own engines)")
        if self.engine_urls and self.replicas > 1:
            raise InvalidInputError(
                "--replicas starts in-process engines; to pool engine servers, repeat --engine-url"
            )
        _check_distinct("--engine-url", self.engine_urls)
        if self.document_kv_max_gib <= 0:
            raise InvalidInputError(f"--document-kv-max-gib must be positive, got {self.document_kv_max_gib}")
        if self.kv_cache_tokens is not None and self.engine_urls:
            raise InvalidInputError(
                "--kv-cache-tokens sizes the in-process engine: give it to `specrag engine` for --engine-url"
            )
        if self.document_kv_dir is not None and (self.engine_urls or self.ray_address is not None):
            raise InvalidInputError(
                "--document-kv turbo needs the in-process engine (no --engine-url, no --ray)"
            )
        if self.engine_kv_events:
            if not self.engine_urls:
                raise InvalidInputError(
                    "--engine-kv-events needs --engine-url (the in-process engine's events are always on)"
                )
            if len(self.engine_kv_events) != len(self.engine_urls):
                raise InvalidInputError(
                    f"give one --engine-kv-events per --engine-url, in the same order: got "
                    f"{len(self.engine_kv_events)} for {len(self.engine_urls)} engines"
                )
            for endpoint in self.engine_kv_events:  # a malformed endpoint fails before any start
                KVEventSource.remote(endpoint)
            _check_distinct("--engine-kv-events", self.engine_kv_events)
        if self.router is not Router.SPECRAG and not self.pooled:
            raise InvalidInputError(
                "--router needs several engines: --replicas N, a repeated --engine-url, or --ray"
            )
        self._check_cpus()

    def _check_cpus(self) -> None:
        """Pinning applies to one in-process engine and to this process; pools place themselves."""
        in_process = not self.engine_urls and self.ray_address is None
        engine: frozenset[int] = frozenset()
        if self.engine_cpus is not None:
            if not in_process or self.replicas > 1:
                raise InvalidInputError(
                    "--engine-cpus pins the one in-process engine; a pool of --replicas puts replica i "
                    "on core i itself, and an --engine-url server or a Ray replica is placed by its host"
                )
            engine = parse_cpus(self.engine_cpus, "--engine-cpus")
        if self.search_cpus is not None:
            search = parse_cpus(self.search_cpus, "--search-cpus")
            if in_process and self.replicas > 1:
                raise InvalidInputError(
                    "--search-cpus: a pool of --replicas already takes one core per replica"
                )
            if in_process and self.engine_cpus is None:
                raise InvalidInputError(
                    "--search-cpus pins this process, where the in-process engine is started and restarted: "
                    "give --engine-cpus too, on other cores"
                )
            if engine & search:
                raise InvalidInputError(
                    f"--engine-cpus and --search-cpus share cores {sorted(engine & search)}: "
                    "overlap needs them apart"
                )

    @property
    def pooled(self) -> bool:
        """Whether the engines make a pool behind a router (several engines, or Ray's replicas)."""
        return self.ray_address is not None or self.replicas > 1 or len(self.engine_urls) > 1


def _check_distinct(flag: str, values: Sequence[str]) -> None:
    """Two replicas on one server would each believe they own its cache: refuse repeats."""
    repeated = sorted({value for value in values if values.count(value) > 1})
    if repeated:
        raise InvalidInputError(f"{flag} given twice for the same engine: {', '.join(repeated)}")


def default_context_length(model_dir: Path) -> int:
    """The context an in-process engine serves ``model_dir`` with: the default's, or the model's
    own when it is shorter (vLLM refuses more)."""
    default = EngineConfig.max_model_len
    return min(default, model_context_length(model_dir) or default)


def base_engine_config(model_dir: Path, options: ServiceOptions) -> EngineConfig:
    """The in-process engines' settings (each replica of a pool derives its own from them)."""
    return EngineConfig(
        model=str(model_dir),
        max_model_len=default_context_length(model_dir),
        enforce_eager=options.eager,
        omp_threads_bind=options.engine_cpus,
        document_kv_dir=options.document_kv_dir,
        document_kv_max_gib=options.document_kv_max_gib,
        kv_cache_tokens=options.kv_cache_tokens,
    )
