"""The public face: every name of torch.utils.data that the spec lists is in ``ferry`` with the
same signature and class relationships; ``__all__`` is sorted; ferry imports ``torch.utils.data``
in one module only (``_torch_types.py``), and only torch's public classes, as base classes."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from torch.utils.data._utils import collate as torch_collate
from torch.utils.data._utils import worker as torch_worker

import ferry
from _support.torch_versions import needs_torch

pytestmark = pytest.mark.usefixtures("guard_global_state")

SRC = pathlib.Path(ferry.__file__).resolve().parent

SPEC_NAMES = [
    "BatchSampler",
    "ChainDataset",
    "ConcatDataset",
    "DataLoader",
    "Dataset",
    "IterableDataset",
    "RandomSampler",
    "Sampler",
    "SequentialSampler",
    "StackDataset",
    "Subset",
    "SubsetRandomSampler",
    "TensorDataset",
    "WeightedRandomSampler",
    "WorkerInfo",
    "collate",
    "default_collate",
    "default_collate_fn_map",
    "default_convert",
    "get_worker_info",
    "random_split",
]


def _torch_object(name: str) -> Any:
    """Where torch keeps the public name (a few live in private modules)."""
    if name in ("collate", "default_collate_fn_map"):
        return getattr(torch_collate, name)
    if name == "WorkerInfo":
        return torch_worker.WorkerInfo
    return getattr(tud, name)


def _params(obj: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(obj).parameters.values()]


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_spec_names_are_exported(name: str) -> None:
    assert hasattr(ferry, name)
    assert name in ferry.__all__


SUBMODULES = ["dataloader", "dataset", "sampler", "distributed"]


@pytest.mark.parametrize("sub", SUBMODULES)
def test_torchs_public_submodules_have_a_ferry_twin(sub: str) -> None:
    """``s/torch.utils.data/ferry/`` works for ``from torch.utils.data.sampler import X`` too:
    each public submodule of torch's has one of the same name in ferry, with the same names,
    each ferry's own object."""
    import importlib

    theirs = importlib.import_module(f"torch.utils.data.{sub}")
    ours = importlib.import_module(f"ferry.{sub}")
    for name in theirs.__all__:
        assert getattr(ours, name) is getattr(ferry, name), (sub, name)
    if sub != "distributed":  # (ferry's distributed module has ferry's own helpers too)
        assert sorted(ours.__all__) == sorted(theirs.__all__)


def test_torchs_documented_collate_path_has_a_ferry_twin() -> None:
    """torch's documentation imports ``collate`` and ``default_collate_fn_map`` from
    ``torch.utils.data._utils.collate``; the same path under ferry gives ferry's."""
    import importlib

    ours = importlib.import_module("ferry._utils.collate")
    collate_module = importlib.import_module("ferry.collate")
    for name in ours.__all__:
        assert hasattr(torch_collate, name), name
        assert getattr(ours, name) is getattr(collate_module, name), name
    assert {"collate", "default_collate_fn_map"} <= set(ours.__all__)


def test_all_is_sorted_and_resolves() -> None:
    assert ferry.__all__ == sorted(ferry.__all__)
    assert len(set(ferry.__all__)) == len(ferry.__all__)
    for name in ferry.__all__:
        assert hasattr(ferry, name), name


# Signatures that differ from torch 2.13's on purpose, each with its reason.
SIGNATURE_EXCEPTIONS = {
    # ferry adds one keyword-only option (checked in test_loader.py).
    "DataLoader",
    # The spec documents Sampler(data_source=None); torch 2.13 dropped the argument. ferry
    # keeps it (and warns that it is ignored) so subclasses written either way work.
    "Sampler",
    # torch's is a dataclass with two torch-internal fields; compared field by field below.
    "WorkerInfo",
}


@pytest.mark.parametrize(
    "name",
    [
        n
        for n in SPEC_NAMES
        if n not in SIGNATURE_EXCEPTIONS and callable(getattr(ferry, n)) and n[0] != "d"
    ]
    + ["default_collate", "default_convert"],
)
def test_signatures_match_torch(name: str) -> None:
    assert _params(getattr(ferry, name)) == _params(_torch_object(name))


def test_sampler_signature_is_the_specs() -> None:
    assert _params(ferry.Sampler) == [
        ("data_source", inspect.Parameter.POSITIONAL_OR_KEYWORD, None)
    ]


def test_random_split_default_generator_is_torchs_default_generator() -> None:
    default = inspect.signature(ferry.random_split).parameters["generator"].default
    assert default is torch.default_generator


@needs_torch("2.13", "a WorkerInfo that is a frozen dataclass")
def test_worker_info_has_the_specs_attributes_and_is_frozen_like_torchs() -> None:
    fields = [f.name for f in dataclasses.fields(ferry.WorkerInfo)]
    if dataclasses.is_dataclass(torch_worker.WorkerInfo):
        torch_fields = [f.name for f in dataclasses.fields(torch_worker.WorkerInfo)]
    else:  # torch < 2.12: a plain class that stores its keyword arguments, in order
        torch_fields = list(vars(torch_worker.WorkerInfo(id=1, num_workers=2, seed=3, dataset=0)))
    spec = ["id", "num_workers", "seed", "dataset"]
    assert fields[:4] == spec == torch_fields[:4]
    info = ferry.WorkerInfo(id=1, num_workers=2, seed=3, dataset="ds")
    expected = torch_worker.WorkerInfo(id=1, num_workers=2, seed=3, dataset="ds")
    with pytest.raises(Exception) as ferry_error:
        info.id = 5  # type: ignore[misc]
    with pytest.raises(Exception) as torch_error:
        expected.id = 5  # type: ignore[misc]
    assert type(ferry_error.value) is type(torch_error.value)
    assert (info.id, info.num_workers, info.seed, info.dataset) == (1, 2, 3, "ds")
    assert "num_workers=2" in repr(info)
    if torch_fields == fields:  # (torch 2.13's fields: its repr, word for word)
        assert repr(info) == repr(expected)


def test_get_worker_info_signature() -> None:
    assert _params(ferry.get_worker_info) == _params(tud.get_worker_info) == []


def test_distributed_sampler() -> None:
    assert "DistributedSampler" in ferry.__all__
    expected = _params(tud.DistributedSampler)
    got = _params(ferry.DistributedSampler)
    assert got[: len(expected)] == expected
    for name, kind, default in got[len(expected) :]:
        # ferry's extensions are keyword-only options with a default (torch's behaviour)
        assert kind is inspect.Parameter.KEYWORD_ONLY, name
        assert default is not inspect.Parameter.empty, name
    assert issubclass(ferry.DistributedSampler, ferry.Sampler)


CLASS_NAMES = [n for n in SPEC_NAMES if inspect.isclass(getattr(ferry, n)) and n != "WorkerInfo"]


@pytest.mark.parametrize(
    ("sub", "base"), list(itertools.permutations(CLASS_NAMES, 2)), ids="{0[0]}<{0[1]}".format
)
def test_class_relationships_match_torch(sub: str, base: str) -> None:
    expected = issubclass(_torch_object(sub), _torch_object(base))
    assert issubclass(getattr(ferry, sub), getattr(ferry, base)) is expected


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_public_names_are_documented(name: str) -> None:
    obj = getattr(ferry, name)
    if name == "default_collate_fn_map":
        return
    assert inspect.getdoc(obj), f"{name} has no docstring"


@pytest.mark.parametrize("name", [*CLASS_NAMES, "DistributedSampler"])
def test_classes_are_generic_like_torchs(name: str) -> None:
    torch_class, ferry_class = _torch_object(name), getattr(ferry, name)
    try:
        torch_class[int]
    except TypeError:
        return
    ferry_class[int]


# -- ferry imports torch.utils.data for its base classes only ------------------------------------

# The one module that may import torch.utils.data, and what it may take from it.
TYPES_MODULE = "_torch_types.py"
BASE_CLASSES = {f"torch.utils.data.{n}" for n in CLASS_NAMES if n != "DistributedSampler"} | {
    "torch.utils.data.distributed.DistributedSampler",
    # the base of ferry's iterators (Lightning's CombinedLoader tests it), imported defensively
    "torch.utils.data.dataloader._BaseDataLoaderIter",
    # the class of a stream loader's sampler (torchdata's StatefulDataLoader tests it)
    "torch.utils.data.dataloader._InfiniteConstantSampler",
}


def _imports_of(source: str) -> list[str]:
    """Module names the source imports, statically or through ``importlib.import_module``/
    ``__import__`` with a literal name."""
    tree = ast.parse(source)
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (
                    isinstance(node.func, ast.Name)
                    and node.func.id in ("__import__", "import_module")
                )
            )
        ):
            names.append(node.args[0].value)
    return names


def _library_files() -> list[pathlib.Path]:
    return [p for p in sorted(SRC.rglob("*.py")) if "bench" not in p.relative_to(SRC).parts]


def test_scanner_finds_imports() -> None:
    """The scan below is only as good as this: it must see every way of importing."""
    found = _imports_of(
        "import torch.utils.data\n"
        "from torch.utils import data\n"
        "from torch.utils.data import DataLoader\n"
        "import importlib\n"
        "importlib.import_module('torch.utils.data.sampler')\n"
        "__import__('torch.utils.data.dataset')\n"
    )
    assert found.count("torch.utils.data") == 3
    for name in (
        "torch.utils.data.DataLoader",
        "torch.utils.data.sampler",
        "torch.utils.data.dataset",
    ):
        assert name in found
    assert _imports_of("import torch\nfrom ferry import collate\n") == [
        "torch",
        "ferry",
        "ferry.collate",
    ]


@pytest.mark.parametrize("path", _library_files(), ids=lambda p: str(p.relative_to(SRC)))
def test_library_modules_do_not_import_torch_utils_data(path: pathlib.Path) -> None:
    imported = [
        name
        for name in _imports_of(path.read_text())
        if name == "torch.utils.data" or name.startswith("torch.utils.data.")
    ]
    if path.name == TYPES_MODULE:
        # `from M import C` yields both M and M.C: the modules themselves are fine, the names
        # taken from them must be the public base classes.
        modules = {
            "torch.utils.data",
            "torch.utils.data.distributed",
            "torch.utils.data.dataloader",
        }
        taken = {name for name in imported if name not in modules}
        assert taken == BASE_CLASSES
        return
    assert imported == [], f"{path.name} imports {imported}"


_RUNTIME_IMPORT_PROBE = """
import builtins, importlib, json, os, sys
import torch  # torch itself imports torch.utils.data; what matters is who asks for it

root = os.path.dirname(os.path.abspath(sys.argv[1]))
offenders = []
real_import, real_import_module = builtins.__import__, importlib.import_module


def caller_in_ferry(depth):
    frame = sys._getframe(depth)
    path = os.path.abspath(frame.f_code.co_filename)
    inside = path.startswith(root) and os.sep + "bench" + os.sep not in path
    return inside and os.path.basename(path) != "_torch_types.py", path


def record(name, fromlist, depth):
    wanted = [name] + [f"{name}.{item}" for item in (fromlist or ())]
    if any(n == "torch.utils.data" or n.startswith("torch.utils.data.") for n in wanted):
        inside, path = caller_in_ferry(depth)
        if inside:
            offenders.append([path, name])


def traced_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0:
        record(name, fromlist, 3)
    return real_import(name, globals, locals, fromlist, level)


def traced_import_module(name, package=None):
    record(name, (), 3)
    return real_import_module(name, package)


builtins.__import__ = traced_import
importlib.import_module = traced_import_module
import ferry, ferry.collate, ferry.datasets, ferry.loader, ferry.samplers
x = torch.arange(8.0).view(4, 2)
for kwargs in ({"batch_size": 2, "shuffle": True}, {"batch_size": None}):
    list(ferry.DataLoader(ferry.TensorDataset(x), **kwargs))
list(ferry.DataLoader(list(range(5)), batch_size=2, collate_fn=lambda b: b))
print(json.dumps(offenders))
"""


@pytest.mark.timeout(60)
def test_ferry_never_imports_torch_utils_data_at_runtime() -> None:
    """``import torch`` already loads torch.utils.data, so sys.modules proves nothing; instead
    every import statement and ``importlib.import_module`` call made from ferry's code (bench
    and the base-class module excepted) is traced while ferry is imported and a loader runs."""
    result = subprocess.run(
        [sys.executable, "-c", _RUNTIME_IMPORT_PROBE, ferry.__file__],
        capture_output=True,
        text=True,
        check=True,
        timeout=50,
    )
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


@pytest.mark.timeout(60)
def test_runtime_import_probe_can_fail() -> None:
    """The probe above sees an import of torch.utils.data made from a file under ferry's root."""
    sample = _RUNTIME_IMPORT_PROBE.replace(
        "import ferry, ferry.collate",
        "exec(compile('import torch.utils.data', os.path.join(root, 'x.py'), 'exec'))\n"
        "import ferry, ferry.collate",
    )
    result = subprocess.run(
        [sys.executable, "-c", sample, ferry.__file__],
        capture_output=True,
        text=True,
        check=True,
        timeout=50,
    )
    offenders = json.loads(result.stdout.strip().splitlines()[-1])
    assert [name for _, name in offenders] == ["torch.utils.data"]
