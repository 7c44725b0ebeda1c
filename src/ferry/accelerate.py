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
right, but nobody has read that version's code. :func:`install` raises if the names it patches are
not there or not what they were.

``DataLoaderConfiguration(use_stateful_dataloader=True)`` makes accelerate build torchdata's
``StatefulDataLoader`` (``DataLoaderAdapter.__init__``) and save each prepared loader's
``state_dict()`` in ``save_state`` (``load_state`` loads it back). A ferry loader is stateful
itself, so while installed the adapter builds ``ferry.DataLoader`` there too (torchdata need not
be installed) and keeps the flag, and ``save_state``/``load_state`` resume it exactly. The one
place accelerate edits the state it saves is the ``DataLoaderDispatcher`` under several
processes (``adjust_state_dict_for_prefetch``: the main process has fetched ``num_processes - 1``
batches past the ones dispatched); it edits torchdata's counters, which a ferry state does not
have, so the dispatcher keeps instead the state ferry's loader had ``num_processes - 1`` batches
earlier (:class:`_StateLag`). Not supported while installed: the Megatron-LM plugin (it builds
``torch.utils.data.DataLoader`` directly, and fails with ``TypeError`` on ``worker_type``).

accelerate is imported by :func:`install` and :func:`uninstall`, not by importing this module;
``import ferry`` never imports either.
"""

from __future__ import annotations

import collections
import functools
import importlib
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator
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
    """What :func:`install` replaced: the constructor, each option key's previous value, and
    the two methods of ``DataLoaderAdapter`` (as found in its ``__dict__``)."""

    data_loader: Any
    options: dict[str, Any]
    adapter_methods: dict[str, Any]


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


def _build_ferry_when_stateful(original: Callable[..., None], _: Any) -> Callable[..., None]:
    """``DataLoaderAdapter.__init__`` that builds the ``DataLoader`` global (ferry's, while
    installed) where accelerate would build torchdata's ``StatefulDataLoader``, and keeps
    ``use_stateful_dataloader`` so that ``save_state``/``load_state`` carry the loader's state."""

    @functools.wraps(original)
    def __init__(
        self: Any, dataset: Any, use_stateful_dataloader: bool = False, **kwargs: Any
    ) -> None:
        original(self, dataset, use_stateful_dataloader=False, **kwargs)
        self.use_stateful_dataloader = use_stateful_dataloader

    return __init__


class _StateLag:
    """The states a ``DataLoaderDispatcher`` took of its ferry loader, the last ``lag + 1``.

    Under several processes the dispatcher's main process fetches ``num_processes`` batches a
    step, one step ahead of what it hands out, and snapshots the state before each fetch: when
    a step is handed out, the newest snapshot is ``num_processes - 1`` batches past it. torchdata's
    state is mended by lowering its counters (``adjust_state_dict_for_prefetch``); a ferry state
    is not a set of counters, so the snapshot taken ``num_processes - 1`` fetches earlier is kept
    instead. With ``split_batches`` (or tensor parallelism) a step is one batch and the newest
    snapshot is the right one; at the end of the data, everything fetched was handed out.
    """

    def __init__(self, lag: int) -> None:
        self.states: collections.deque[dict[str, Any]] = collections.deque(maxlen=lag + 1)

    def taken(self, state: dict[str, Any], at_end: bool) -> dict[str, Any]:
        """Records ``state``, the newest snapshot, and returns the one that resumes right."""
        self.states.append(state)
        return dict(state if at_end else self.states[0])


def _adjust_ferry_states(
    original: Callable[[Any], None], data_loader: Any
) -> Callable[[Any], None]:
    """``DataLoaderAdapter.adjust_state_dict_for_prefetch`` that leaves loaders other than
    ferry's to accelerate, and keeps a ferry loader's state where it resumes right: as taken,
    except in a ``DataLoaderDispatcher`` that fetches several batches a step (``SkipDataLoader``
    snapshots after each batch it hands out; ``DataLoaderShard`` has its own method)."""
    dispatcher = data_loader.DataLoaderDispatcher

    @functools.wraps(original)
    def adjust_state_dict_for_prefetch(self: Any) -> None:
        if not isinstance(self.base_dataloader, DataLoader):
            original(self)
            return
        if not isinstance(self, dispatcher) or self.split_batches or self.submesh_tp:
            return
        lag = self.state.num_processes - 1
        if lag == 0:
            return
        keeper = self.__dict__.get("_ferry_state_lag")  # (not __getattr__: the base loader's)
        if keeper is None:
            keeper = self.__dict__["_ferry_state_lag"] = _StateLag(lag)
        self.dl_state_dict = keeper.taken(self.dl_state_dict, bool(self.end_of_dataloader))

    return adjust_state_dict_for_prefetch


_ADAPTER_PATCHES = {
    "__init__": _build_ferry_when_stateful,
    "adjust_state_dict_for_prefetch": _adjust_ferry_states,
}


def _check(package: Any, data_loader: Any) -> tuple[Any, dict[str, Any]]:
    """accelerate's constructor global and options dict, after checking they are what we know."""
    version = str(getattr(package, "__version__", "unknown"))
    constructor = getattr(data_loader, "DataLoader", None)
    options = getattr(data_loader, "_PYTORCH_DATALOADER_KWARGS", None)
    adapter = getattr(data_loader, "DataLoaderAdapter", None)
    if not (
        isinstance(constructor, type)
        and constructor.__name__ == "DataLoader"
        and constructor.__module__.startswith("torch.utils.data")
        and isinstance(options, dict)
        and "num_workers" in options
        and isinstance(adapter, type)
        and all(callable(vars(adapter).get(name)) for name in _ADAPTER_PATCHES)
        and isinstance(getattr(data_loader, "DataLoaderDispatcher", None), type)
    ):
        raise RuntimeError(
            f"ferry.accelerate.install() cannot patch accelerate {version}: "
            "accelerate.data_loader.DataLoader is not torch's DataLoader, "
            "accelerate.data_loader._PYTORCH_DATALOADER_KWARGS is not the dict of loader "
            "options, accelerate.data_loader.DataLoaderAdapter lacks "
            f"{' or '.join(_ADAPTER_PATCHES)}, or there is no DataLoaderDispatcher, as they "
            "were in the versions checked "
            f"({', '.join(CHECKED_VERSIONS)}); found DataLoader={constructor!r}"
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
        adapter = data_loader.DataLoaderAdapter
        methods = {name: vars(adapter)[name] for name in _ADAPTER_PATCHES}
        _state.saved = _Saved(
            constructor, {name: options.get(name, _MISSING) for name in added}, methods
        )
        options.update(added)
        data_loader.DataLoader = DataLoader
        for name, patch in _ADAPTER_PATCHES.items():
            setattr(adapter, name, patch(methods[name], data_loader))


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
        for name, method in saved.adapter_methods.items():
            setattr(data_loader.DataLoaderAdapter, name, method)
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
