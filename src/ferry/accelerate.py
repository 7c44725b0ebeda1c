"""Keep ferry's engine under Hugging Face ``accelerate``.

``Accelerator.prepare(loader)`` does not wrap a loader: it rebuilds it.
``accelerate.data_loader.DataLoaderShard``, ``DataLoaderDispatcher`` and ``SkipDataLoader``
(and ``skip_first_batches``) construct ``DataLoader(dataset, batch_sampler=..., **kwargs)`` with
the ``DataLoader`` global of ``accelerate.data_loader``, which is torch's, and with the options
read back from the original loader for the keys of ``_PYTORCH_DATALOADER_KWARGS``. A prepared
ferry loader therefore yields the right data, but on torch's engine, and ferry's own options
(``worker_type="thread"``) are dropped.

:func:`install` points that global at :class:`ferry.DataLoader` and adds ferry's own keywords
(those of ``ferry.DataLoader`` that torch's loader lacks, with their defaults) to
``_PYTORCH_DATALOADER_KWARGS`` so that they are carried through the rebuild. While installed,
every loader accelerate prepares runs on ferry's engine, torch loaders included (they get
ferry's defaults for ferry's options). :func:`uninstall` puts back exactly what was there;
:func:`installed` does both around a block.

Example::

    >>> import ferry.accelerate
    >>> ferry.accelerate.install()
    >>> loader = ferry.DataLoader(dataset, batch_size=32, num_workers=4, worker_type="thread")
    >>> loader, model, optimizer = accelerator.prepare(loader, model, optimizer)
    >>> loader.base_dataloader.worker_type
    'thread'

Checked against accelerate 1.15.0 (``CHECKED_VERSIONS``): there ``DataLoader`` is used
only as a constructor (``DataLoaderAdapter.__init__``, the fallback of ``skip_first_batches``)
and in annotations, and ``_PYTORCH_DATALOADER_KWARGS`` is read only to collect the options of a
rebuild. Another version gets a warning, not an error: the patch is small and likely still
right, but nobody has read that version's code. :func:`install` raises if the two names are not
there or not what they were. Not supported while installed (the rebuild raises ``TypeError``
on ``worker_type``): ``use_stateful_dataloader=True`` (torchdata's ``StatefulDataLoader`` is
built instead of ``DataLoader``) and the Megatron-LM plugin (it builds
``torch.utils.data.DataLoader`` directly, with the same keywords).

accelerate is imported by :func:`install` and :func:`uninstall`, not by importing this module;
``import ferry`` never imports either.
"""

from __future__ import annotations

import importlib
import inspect
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ferry.loader import DataLoader

__all__ = ["CHECKED_VERSIONS", "install", "installed", "is_installed", "uninstall"]

CHECKED_VERSIONS: tuple[str, ...] = ("1.15.0",)
"""The accelerate versions whose ``data_loader`` module was read to write this patch."""

_MISSING = object()


def _accelerate_modules() -> tuple[Any, Any]:
    try:
        # Through importlib: accelerate ships no type information.
        package = importlib.import_module("accelerate")
        data_loader = importlib.import_module("accelerate.data_loader")
    except ImportError as exc:
        raise ImportError(
            "ferry.accelerate patches Hugging Face accelerate, which is not installed: "
            "pip install accelerate"
        ) from exc
    return package, data_loader


@dataclass
class _Saved:
    """What :func:`install` replaced: the constructor, and each option key's previous value."""

    data_loader: Any
    options: dict[str, Any]


class _State:
    """The patch in effect: ``saved`` is None when ferry is not installed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.saved: _Saved | None = None


_state = _State()


def _ferry_only_options(torch_loader: Any) -> dict[str, Any]:
    """The keywords of ``ferry.DataLoader`` that ``torch_loader`` lacks, with their defaults."""
    torch_names = set(inspect.signature(torch_loader).parameters)
    return {
        name: param.default
        for name, param in inspect.signature(DataLoader.__init__).parameters.items()
        if name not in torch_names
        and name != "self"
        and param.default is not inspect.Parameter.empty
        and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
    }


def _check(package: Any, data_loader: Any) -> tuple[Any, dict[str, Any]]:
    """accelerate's constructor global and options dict, after checking they are what we know."""
    version = str(getattr(package, "__version__", "unknown"))
    constructor = getattr(data_loader, "DataLoader", None)
    options = getattr(data_loader, "_PYTORCH_DATALOADER_KWARGS", None)
    if not (
        isinstance(constructor, type)
        and constructor.__name__ == "DataLoader"
        and constructor.__module__.startswith("torch.utils.data")
        and isinstance(options, dict)
        and "num_workers" in options
    ):
        raise RuntimeError(
            f"ferry.accelerate.install() cannot patch accelerate {version}: "
            "accelerate.data_loader.DataLoader is not torch's DataLoader or "
            "accelerate.data_loader._PYTORCH_DATALOADER_KWARGS is not the dict of loader "
            f"options it was in the versions checked ({', '.join(CHECKED_VERSIONS)}), "
            f"found DataLoader={constructor!r}"
        )
    if version not in CHECKED_VERSIONS:
        warnings.warn(
            f"ferry.accelerate was checked against accelerate {', '.join(CHECKED_VERSIONS)}, "
            f"this is accelerate {version}: prepared loaders should still run on ferry's "
            "engine, but check them (prepared.base_dataloader is a ferry.DataLoader)",
            UserWarning,
            stacklevel=3,
        )
    return constructor, options


def install() -> None:
    """Make accelerate build the loaders it prepares with :class:`ferry.DataLoader`.

    Replaces ``accelerate.data_loader.DataLoader`` with ``ferry.DataLoader`` and adds ferry's
    own keywords (``worker_type``, ``on_error``, ...: every keyword torch's loader lacks) with
    their defaults to
    ``accelerate.data_loader._PYTORCH_DATALOADER_KWARGS``, so that ``Accelerator.prepare`` and
    ``skip_first_batches`` keep ferry's engine and options. Calling it again does nothing.

    Example::

        >>> ferry.accelerate.install()
        >>> loader = ferry.DataLoader(ds, num_workers=2, worker_type="thread")
        >>> prepared = accelerator.prepare(loader)
        >>> prepared.base_dataloader.worker_type
        'thread'
    """
    package, data_loader = _accelerate_modules()
    with _state.lock:
        if _state.saved is not None:
            return
        constructor, options = _check(package, data_loader)
        added = _ferry_only_options(constructor)
        _state.saved = _Saved(constructor, {name: options.get(name, _MISSING) for name in added})
        options.update(added)
        data_loader.DataLoader = DataLoader


def uninstall() -> None:
    """Undo :func:`install`: accelerate's ``DataLoader`` global and option keys are put back.

    Does nothing if ferry is not installed. Loaders prepared meanwhile stay ferry loaders.

    Example::

        >>> ferry.accelerate.uninstall()
        >>> accelerate.data_loader.DataLoader is torch.utils.data.DataLoader
        True
    """
    _, data_loader = _accelerate_modules()
    with _state.lock:
        saved = _state.saved
        if saved is None:
            return
        options = data_loader._PYTORCH_DATALOADER_KWARGS
        for name, previous in saved.options.items():
            if previous is _MISSING:
                options.pop(name, None)
            else:
                options[name] = previous
        data_loader.DataLoader = saved.data_loader
        _state.saved = None


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _state.saved is not None


@contextmanager
def installed() -> Iterator[None]:
    """:func:`install` for the duration of a ``with`` block, then :func:`uninstall`.

    If ferry was already installed when the block starts, it stays installed after it, so
    blocks nest.

    Example::

        >>> with ferry.accelerate.installed():
        ...     loader = accelerator.prepare(ferry.DataLoader(ds, batch_size=8))
        >>> type(loader.base_dataloader)
        <class 'ferry.loader.DataLoader'>
    """
    was_installed = is_installed()
    install()
    try:
        yield
    finally:
        if not was_installed:
            uninstall()
