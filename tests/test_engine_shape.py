"""The engine's objects stay small and single-minded (docs/design/modules.md).

* No engine class has two or more engine bases: a concern is an object the class holds (the
  worker iterator holds its crew, incidents and auto's move), not a mixin.
* No engine object holds more than 15 attributes over its class and its engine bases
  (``self.x = ...`` anywhere in their methods, and class-level annotations). Frozen
  dataclasses are exempt: they are records of values passed as one (a loader's options for an
  epoch, a worker's start-up configuration, a message), not objects with behaviour and state.

Read from the source (``ast``), so nothing is imported or run.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parent.parent / "src" / "ferry" / "_engine"
MOST_ATTRIBUTES = 15


@dataclass
class EngineClass:
    name: str
    path: Path
    bases: list[str]
    attributes: set[str]
    record: bool  # a frozen dataclass


def _is_frozen_dataclass(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        if isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith("dataclass"):
            for keyword in decorator.keywords:
                if keyword.arg == "frozen" and ast.unparse(keyword.value) == "True":
                    return True
    return False


def _attributes(node: ast.ClassDef) -> set[str]:
    found = {
        item.target.id
        for item in node.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    }
    for sub in ast.walk(node):
        targets: list[ast.expr] = []
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        for target in targets:
            for part in ast.walk(target):
                if (
                    isinstance(part, ast.Attribute)
                    and isinstance(part.value, ast.Name)
                    and part.value.id == "self"
                ):
                    found.add(part.attr)
    return found


def _engine_classes() -> dict[str, EngineClass]:
    classes: dict[str, EngineClass] = {}
    for path in sorted(ENGINE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).split("[")[0].split(".")[-1] for b in node.bases]
                classes[node.name] = EngineClass(
                    node.name, path, bases, _attributes(node), _is_frozen_dataclass(node)
                )
    return classes


CLASSES = _engine_classes()


def _engine_bases(cls: EngineClass) -> list[str]:
    return [b for b in cls.bases if b in CLASSES and b != cls.name]


def _all_attributes(cls: EngineClass) -> set[str]:
    found = set(cls.attributes)
    for base in _engine_bases(cls):
        found |= _all_attributes(CLASSES[base])
    return found


def test_the_engine_has_classes_to_check() -> None:
    assert {"WorkerIterator", "Crew", "EpochTrack", "EpochKeys"} <= CLASSES.keys()


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_no_engine_class_has_two_engine_bases(name: str) -> None:
    cls = CLASSES[name]
    assert len(_engine_bases(cls)) < 2, f"{name} ({cls.path.name}) mixes {_engine_bases(cls)}"


@pytest.mark.parametrize("name", sorted(n for n, c in CLASSES.items() if not c.record))
def test_no_engine_object_holds_more_than_15_attributes(name: str) -> None:
    held = _all_attributes(CLASSES[name])
    assert len(held) <= MOST_ATTRIBUTES, f"{name} holds {len(held)}: {sorted(held)}"


def test_the_checks_count_what_they_should() -> None:
    source = (
        "class A:\n    x: int\n    def f(self):\n        self.y = 1\n        self.z += 1\n"
        "@dataclass(frozen=True)\nclass R:\n    a: int\n"
    )
    nodes = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)]
    assert _attributes(nodes[0]) == {"x", "y", "z"}
    assert not _is_frozen_dataclass(nodes[0])
    assert _is_frozen_dataclass(nodes[1])
