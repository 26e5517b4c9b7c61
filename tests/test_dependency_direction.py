"""The dependency direction (docs/architecture.md), read from the source: service -> controller ->
pipeline -> cache, retrieval; inside the service cli -> run -> http; inside the pipeline models <-
document_kv <- engines <- kv_mirror, and store beside the engines; inside retrieval the index
facade (vector_index.py and its parts in index/) over backends/ (local, shards, pgvector) over
search, lexical and embedders. The leaf
modules (atomic, errors, locking, paths, ray_placement) serve everyone; the client needs only errors; the
simulator (sim) sits beside the product, which never imports it. Function-level imports count
too: an import that runs back up is one, wherever it sits."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "specrag"
LEAVES = {"atomic", "errors", "locking", "paths", "ray_placement"}
ALLOWED = {
    "cache": LEAVES | {"cache"},
    "retrieval": LEAVES | {"retrieval"},
    "pipeline": LEAVES | {"pipeline", "cache", "retrieval"},
    "controller": LEAVES | {"controller", "pipeline", "cache", "retrieval"},
    "sim": LEAVES | {"sim", "controller", "pipeline", "cache", "retrieval"},
}

# The pipeline's rooms (specrag/pipeline/<room>/): what each may import besides the leaves. Model files know
# no engine and no passage; the document KV needs only the model's weights digest; the engines load models
# and document KV but know nothing of passages, prompts or the knowledge tree; the KV mirror follows an
# engine's events into the tree; the store (passages, live corpus, prompts) never starts or asks an engine.
PIPELINE_ROOMS = {
    "models": LEAVES | {"pipeline.models"},
    "document_kv": LEAVES | {"pipeline.document_kv", "pipeline.models"},
    "engines": LEAVES | {"pipeline.engines", "pipeline.models", "pipeline.document_kv"},
    "kv_mirror": LEAVES | {"pipeline.kv_mirror", "pipeline.engines", "cache"},
    "store": LEAVES | {"pipeline.store", "pipeline.models", "pipeline.document_kv", "cache", "retrieval"},
}
# What the pipeline keeps outside its rooms: the package doc and its command-line sub-commands.
PIPELINE_TOP = {"__init__.py", "commands.py"}

# The retrieval's rooms (specrag/retrieval/<room>/, a backend one level down: backends/<backend>/) and
# the modules beside them that a room uses: what each may import besides the leaves, a room or a
# module beside the rooms named by its place under specrag/retrieval/. The staged search, the lexical
# channel and the embedders know no backend and no index; a backend knows the staged search, not the
# index facade (index_store, vector_index, the backends' contract and registry, ...) above it; the
# shared modules import no room above them; the
# facade's parts (index/: the searcher as its capabilities open it, rows, the hybrid channel) sit
# above the rooms and below the facade modules, and name no backend but the shards' answers record.
RETRIEVAL_ROOMS = {
    "search": LEAVES | {"search"},
    "lexical": LEAVES | {"lexical", "text"},
    "embedders": LEAVES | {"embedders", "arrays"},
    "backends.local": LEAVES | {"backends.local", "search", "live_index", "progress"},
    "backends.shards": LEAVES
    | {"backends.shards", "backends.local", "search", "live_index", "arrays", "index_files", "embedders"},
    "backends.pgvector": LEAVES
    | {"backends.pgvector", "backends.local", "search", "live_index", "corpus", "embedders", "lexical"}
    | {"text"},
    "arrays": LEAVES,
    "text": LEAVES,
    "corpus": LEAVES,
    "index_files": LEAVES,
    "live_index": LEAVES | {"lexical"},
    "progress": LEAVES | {"embedders"},
    "index": LEAVES | {"index", "search", "lexical", "live_index", "backends.shards"},
}
# The index facade beside the rooms: above every room, so it has no rule but the package's.
# In backends/ beside the backends' rooms: the contract every backend keeps and the registry that
# names each one once, both part of the facade (they put the index around a backend's searcher).
BACKENDS_FACADE = {"__init__.py", "contract.py", "registry.py"}
RETRIEVAL_FACADE = {
    "__init__.py",
    "commands.py",
    "conversational.py",
    "corpus_change.py",
    "index_store.py",
    "synthetic.py",
    "vector_index.py",
}

# Inside the service, the rooms a room must not import: the command line sits on top, the start and
# run of a service below it, the HTTP application at the bottom.
SERVICE_ROOMS_ABOVE = {
    "http": {"cli", "run"},
    "run": {"cli"},
}


def imported_names(source: Path) -> set[str]:
    """Every module of specrag this file imports (``from a import b`` counts ``a``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {name for name in names if name.startswith("specrag.")}


def imported_parts(source: Path) -> set[str]:
    """The first component under ``specrag`` of every module this file imports."""
    return {name.split(".")[1] for name in imported_names(source)}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_what_lies_below_it(package: str) -> None:
    sources = sorted((PACKAGE / package).rglob("*.py"))
    assert sources
    wrong = {
        str(source.relative_to(PACKAGE)): sorted(imported_parts(source) - ALLOWED[package])
        for source in sources
    }
    assert {name: parts for name, parts in wrong.items() if parts} == {}


def imported_rooms(source: Path) -> set[str]:
    """As :func:`imported_parts`, an import of the pipeline named by its room (``pipeline.engines``)."""
    rooms: set[str] = set()
    for name in imported_names(source):
        parts = name.split(".")
        rooms.add(".".join(parts[1:3]) if parts[1] == "pipeline" else parts[1])
    return rooms


def imported_service_rooms(source: Path) -> set[str]:
    """The rooms of ``specrag.service`` (``http``, ``run``, ``cli``, ...) this file imports from."""
    return {name.split(".")[2] for name in imported_names(source) if name.startswith("specrag.service.")}


@pytest.mark.parametrize("room", sorted(PIPELINE_ROOMS))
def test_a_pipeline_room_imports_only_the_rooms_below_it(room: str) -> None:
    sources = sorted((PACKAGE / "pipeline" / room).rglob("*.py"))
    assert sources
    wrong = {
        str(source.relative_to(PACKAGE)): sorted(imported_rooms(source) - PIPELINE_ROOMS[room])
        for source in sources
    }
    assert {name: rooms for name, rooms in wrong.items() if rooms} == {}


@pytest.mark.parametrize("room", sorted(SERVICE_ROOMS_ABOVE))
def test_a_service_room_imports_no_room_above_it(room: str) -> None:
    sources = sorted((PACKAGE / "service" / room).rglob("*.py"))
    assert sources
    wrong = {
        str(source.relative_to(PACKAGE)): sorted(imported_service_rooms(source) & SERVICE_ROOMS_ABOVE[room])
        for source in sources
    }
    assert {name: rooms for name, rooms in wrong.items() if rooms} == {}


def test_every_pipeline_module_lives_in_a_room() -> None:
    """A new module goes into the room whose rule it keeps, so the rules above cover all of it."""
    pipeline = PACKAGE / "pipeline"
    assert {path.name for path in pipeline.glob("*.py")} == PIPELINE_TOP
    rooms = {path.name for path in pipeline.iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert rooms == set(PIPELINE_ROOMS)


def retrieval_place(name: str) -> str:
    """Where under specrag/retrieval/ the module ``name`` lives, as RETRIEVAL_ROOMS names it
    (``backends.local``, ``search``, ``live_index``); a module outside retrieval by its package."""
    parts = name.split(".")
    if parts[1] != "retrieval":
        return parts[1]
    if len(parts) == 2:
        return "retrieval"
    return ".".join(parts[2:4]) if parts[2] == "backends" and len(parts) > 3 else parts[2]


def retrieval_sources(place: str) -> list[Path]:
    """The files of a room (every file under it) or of a module beside the rooms."""
    path = PACKAGE / "retrieval" / place.replace(".", "/")
    return sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]


@pytest.mark.parametrize("place", sorted(RETRIEVAL_ROOMS))
def test_a_retrieval_room_imports_only_the_rooms_below_it(place: str) -> None:
    sources = retrieval_sources(place)
    assert all(source.exists() for source in sources)
    wrong = {
        str(source.relative_to(PACKAGE)): sorted(
            {retrieval_place(name) for name in imported_names(source)} - RETRIEVAL_ROOMS[place]
        )
        for source in sources
    }
    assert {name: places for name, places in wrong.items() if places} == {}


def test_every_retrieval_module_lives_in_a_room_or_the_facade() -> None:
    """A new module goes into the room whose rule it keeps (or is named facade or shared here), so
    the rules above cover all of retrieval."""
    retrieval = PACKAGE / "retrieval"
    rooms = {place for place in RETRIEVAL_ROOMS if (retrieval / place.replace(".", "/")).is_dir()}
    shared = {f"{place}.py" for place in set(RETRIEVAL_ROOMS) - rooms}
    assert {path.name for path in retrieval.glob("*.py")} == RETRIEVAL_FACADE | shared
    found = {
        str(path.relative_to(retrieval)).replace("/", ".")
        for path in [*retrieval.iterdir(), *(retrieval / "backends").iterdir()]
        if path.is_dir() and path.name != "__pycache__"
    }
    assert found - {"backends"} == rooms
    assert {path.name for path in (retrieval / "backends").glob("*.py")} == BACKENDS_FACADE


def test_retrieval_places_are_read_as_the_rules_name_them() -> None:
    assert retrieval_place("specrag.retrieval.backends.local.staged_ivf") == "backends.local"
    assert retrieval_place("specrag.retrieval.backends.local") == "backends.local"
    assert retrieval_place("specrag.retrieval.search.stages") == "search"
    assert retrieval_place("specrag.retrieval.live_index") == "live_index"
    assert retrieval_place("specrag.retrieval") == "retrieval"
    assert retrieval_place("specrag.errors") == "errors"


def test_only_the_simulator_imports_the_simulator() -> None:
    """The product's real path never loads the simulated engine or virtual time: only benchmarks
    and tests do."""
    sources = sorted(
        source for source in PACKAGE.rglob("*.py") if "sim" not in source.relative_to(PACKAGE).parts[:1]
    )
    assert sources
    assert [str(source.relative_to(PACKAGE)) for source in sources if "sim" in imported_parts(source)] == []


def test_the_client_imports_only_errors() -> None:
    assert imported_parts(PACKAGE / "client.py") == {"errors"}


def module_name(source: Path) -> str:
    parts = source.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: Path, known: set[str]) -> set[str]:
    """The specrag modules this file imports, function-level imports included (``from a import b``
    counts ``a.b`` when that is a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found & known


def test_no_module_of_specrag_imports_itself_back() -> None:
    """No import circle, however long, wherever the imports sit (a lazy import closes one too)."""
    sources = {module_name(source): source for source in PACKAGE.rglob("*.py")}
    known = set(sources)
    graph = {name: imported_modules(source, known) - {name} for name, source in sources.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for child in sorted(graph[name]):
            if state.get(child) == 1:
                cycles.append(" -> ".join([*path[path.index(child) :], child]))
            elif child not in state:
                visit(child, [*path, child])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []
