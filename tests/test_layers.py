"""ferry's modules form layers, and imports go one way: down (docs/design/modules.md).

Lowest first: ``_core`` (RNG states, the allocator, worker info, rank and world, memory
measures: what everything builds on); the public description modules (datasets, samplers,
collate, distributed, stats, errors, and their private helpers); ``_engine`` (how batches are
made: iterators, workers, transport); the loader (and the package's own namespace); the tools
(doctor, bench, the command line). A module may import from its own layer and those below; an
import that goes up fails this test, wherever it is written (at the top, in a function, under
``TYPE_CHECKING``). The doctor and the bench share what both need through ``ferry._cli``, never
each other.

Inside the engine the same rule holds between its rooms (``ENGINE_LAYERS``, lowest first: the
plan and failure policy; ``work``, making a batch; ``position``, where the epoch stands;
``transport``, messages and slabs; ``crew``, the workers; the scheduler; ``tuning``; the main
loop), and no engine module imports, even indirectly, one that imports it back.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("ferry._core",)),
    (
        "description",
        (
            "ferry.errors",
            "ferry._validate",
            "ferry._torch_types",
            "ferry._structure",
            "ferry._batching",
            "ferry._sampler_state",
            "ferry.samplers",
            "ferry._sampler_keys",
            "ferry.datasets",
            "ferry.collate",
            "ferry.distributed",
            "ferry.stats",
            "ferry.shared_list",
            "ferry.dataset",
            "ferry.sampler",
            "ferry._utils",
        ),
    ),
    ("engine", ("ferry._engine",)),
    (
        "loader",
        ("ferry.loader", "ferry.dataloader", "ferry._sampling", "ferry.accelerate", "ferry"),
    ),
    ("tools", ("ferry._cli", "ferry.doctor", "ferry.bench", "ferry.__main__")),
]
# The engine's rooms (docs/design/modules.md), lowest first; the longest prefix decides.
ENGINE_LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("plan", ("ferry._engine.plan", "ferry._engine.failures")),
    ("work", ("ferry._engine.work",)),
    ("position", ("ferry._engine.position",)),
    ("transport", ("ferry._engine.transport",)),
    ("crew", ("ferry._engine.crew",)),
    ("schedule", ("ferry._engine.schedule",)),
    ("tuning", ("ferry._engine.tuning",)),
    ("loop", ("ferry._engine",)),
]
# Tools that must not import each other (what they share is in ferry._cli).
APART = ("ferry.doctor", "ferry.bench")


def _layer(module: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> int:
    """The layer of ``module``: the one whose prefix matches it longest."""
    best, rank = -1, -1
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    if rank < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return rank


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "ferry").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every ferry module ``path`` imports."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
            # "from ferry._engine import pool" imports the module ferry._engine.pool.
            found += [(node.lineno, n if n in _modules() else base) for n in names]
    return [(line, name) for line, name in found if name == "ferry" or name.startswith("ferry.")]


def test_every_module_is_in_a_layer() -> None:
    for module in _modules():
        _layer(module)


@pytest.mark.parametrize("module", sorted(_modules()))
def test_imports_go_down_the_layers(module: str) -> None:
    path = _modules()[module]
    own = _layer(module)
    upward = [
        f"{path.relative_to(SRC)}:{line} imports {target} ({LAYERS[_layer(target)][0]} layer)"
        for line, target in _imports(path, module)
        if _layer(target) > own
    ]
    assert not upward, (
        f"{module} is in the {LAYERS[own][0]} layer; imports going up:\n" + "\n".join(upward)
    )


@pytest.mark.parametrize("module", sorted(m for m in _modules() if m.startswith(APART)))
def test_the_doctor_and_the_bench_import_each_other_nothing(module: str) -> None:
    own = next(prefix for prefix in APART if module.startswith(prefix))
    other = next(prefix for prefix in APART if prefix != own)
    crossing = [t for _, t in _imports(_modules()[module], module) if t.startswith(other)]
    assert not crossing, f"{module} imports {crossing}: share it through ferry._cli"


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    """The check itself: a core module importing the engine is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("from ferry._engine.pool import WorkerIterator\nimport ferry.loader\n")
    targets = [t for _, t in _imports(bad, "ferry._core.bad")]
    assert targets == ["ferry._engine.pool", "ferry.loader"]
    assert all(_layer(t) > _layer("ferry._core.bad") for t in targets)


def _engine_modules() -> list[str]:
    return sorted(m for m in _modules() if m.startswith("ferry._engine"))


@pytest.mark.parametrize("module", _engine_modules())
def test_engine_imports_go_down_its_rooms(module: str) -> None:
    path = _modules()[module]
    own = _layer(module, ENGINE_LAYERS)
    upward = [
        f"{path.relative_to(SRC)}:{line} imports {target} "
        f"({ENGINE_LAYERS[_layer(target, ENGINE_LAYERS)][0]})"
        for line, target in _imports(path, module)
        if target.startswith("ferry._engine") and _layer(target, ENGINE_LAYERS) > own
    ]
    assert not upward, (
        f"{module} is in the engine's {ENGINE_LAYERS[own][0]} room; imports going up:\n"
        + "\n".join(upward)
    )


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle found by a depth-first walk of ``graph``."""
    state: dict[str, int] = {}  # 1: on the walk's path, 2: done
    path: list[str] = []
    found: list[list[str]] = []

    def walk(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                found.append([*path[path.index(target) :], target])
            elif target in graph and target not in state:
                walk(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module)
    return found


def test_no_import_circle_in_the_engine() -> None:
    graph = {
        m: {t for _, t in _imports(_modules()[m], m) if t.startswith("ferry._engine") and t != m}
        for m in _engine_modules()
    }
    assert _circles(graph) == []
    # the check itself
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_engine_is_divided_into_rooms() -> None:
    """Sub-packages by concern, and few modules left flat beside them."""
    engine = SRC / "ferry" / "_engine"
    rooms = [p for p in engine.iterdir() if (p / "__init__.py").is_file()]
    flat = [p for p in engine.glob("*.py") if p.name != "__init__.py"]
    assert len(rooms) >= 3, rooms
    assert len(flat) <= 8, sorted(p.name for p in flat)
    for room in rooms:  # each room says what it owns and what it may touch
        assert ast.get_docstring(ast.parse((room / "__init__.py").read_text())), room
