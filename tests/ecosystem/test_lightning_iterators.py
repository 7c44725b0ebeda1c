"""ferry's loader hands out its iterators as torch's does, for code that reaches into them.

* ``DataLoader.__iter__`` obtains its iterator from ``self._get_iterator()`` (also with
  persistent workers, where the kept iterator is ``_reset`` each epoch): Lightning's tests and
  user subclasses override it to observe or wrap iterators. An override may return an iterator
  ferry did not make (torch's own): ferry then runs it as torch would, and ``state_dict()``
  says it cannot describe it.
* The iterators are ``torch.utils.data.dataloader._BaseDataLoaderIter`` instances, so
  Lightning's ``CombinedLoader`` leaves them out when it is pickled mid-epoch, as it does
  torch's, and goes on.

Every program runs with torch's classes and with ferry's, and must behave the same.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from lightning.pytorch.utilities.combined_loader import CombinedLoader

import ferry

pytestmark = [
    pytest.mark.usefixtures("guard_global_state"),
    # Lightning's CombinedLoader uses a torch pytree API that torch 2.13 deprecates.
    pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\).*:FutureWarning"),
]

IMPLS: dict[str, Any] = {"torch": tud, "ferry": ferry}
WORKERS = [(0, False), (2, False), (2, True)]


def _options(workers: int, persistent: bool) -> dict[str, Any]:
    options: dict[str, Any] = {"batch_size": 3}
    if workers:
        options.update(
            num_workers=workers, persistent_workers=persistent, multiprocessing_context="fork"
        )
    return options


def _data(impl: str, rows: int = 10) -> Any:
    return IMPLS[impl].TensorDataset(torch.arange(rows))


def _plain(batches: Any) -> list[list[int]]:
    return [batch[0].tolist() for batch in batches]


class _Wrapper:
    """An iterator that wraps the loader's and counts what passes, as a user override might;
    it forwards torch's ``_reset`` (persistent workers) to the iterator it wraps."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.passed = 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        batch = next(self.inner)
        self.passed += 1
        return batch

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        self.inner._reset(loader, first_iter)

    def _shutdown_workers(self) -> None:
        shutdown = getattr(self.inner, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def _observing_loader(impl: str, how: str) -> type:
    """A DataLoader subclass whose ``_get_iterator`` counts its calls and ``how``: ``"observe"``
    (returns the loader's own iterator), ``"wrap"`` (in a :class:`_Wrapper`) or ``"torch"``
    (returns torch's own iterator for this loader)."""

    class Observing(IMPLS[impl].DataLoader):  # type: ignore[misc, name-defined]
        calls = 0

        def _get_iterator(self) -> Any:
            type(self).calls += 1
            if how == "wrap":
                return _Wrapper(super()._get_iterator())
            if how == "torch":
                if self.num_workers == 0:
                    return tud.dataloader._SingleProcessDataLoaderIter(self)
                return tud.dataloader._MultiProcessingDataLoaderIter(self)
            return super()._get_iterator()

    return Observing


def _run_override(impl: str, how: str, workers: int, persistent: bool) -> dict[str, Any]:
    cls = _observing_loader(impl, how)
    loader = cls(_data(impl), shuffle=True, **_options(workers, persistent))
    torch.manual_seed(0)
    epochs = []
    for _ in range(3):
        epochs.append(_plain(loader))
    iterator = loader._iterator
    out = {
        "epochs": epochs,
        "calls": cls.calls,
        # torch keeps its iterator with persistent workers; the kind of iterator differs
        "kept": None if iterator is None else how == "wrap" or type(iterator).__name__,
        "is_torch_iterator": isinstance(iter(loader), tud.dataloader._BaseDataLoaderIter),
    }
    loader._iterator = None  # what Lightning does between stages: stops kept workers
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("workers", "persistent"), WORKERS)
@pytest.mark.parametrize("how", ["observe", "wrap", "torch"])
def test_get_iterator_overrides_are_called_as_torch_calls_them(
    how: str, workers: int, persistent: bool
) -> None:
    want = _run_override("torch", how, workers, persistent)
    # torch makes a new iterator per epoch, or one kept and reset with persistent workers.
    assert want["calls"] == (1 if persistent else 3)
    got = _run_override("ferry", how, workers, persistent)
    if how != "torch" and want["kept"] is not None:
        assert (want["kept"], got["kept"]) in {
            (True, True),
            ("_MultiProcessingDataLoaderIter", "WorkerIterator"),
        }
        got["kept"] = want["kept"]
    assert got == want


@pytest.mark.timeout(60)
def test_state_dict_of_a_foreign_iterator_says_it_cannot() -> None:
    loader = _observing_loader("ferry", "torch")(_data("ferry"), batch_size=3)
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(TypeError, match=r"cannot describe the iterator that Observing\._get_it"):
        loader.state_dict()


@pytest.mark.timeout(60)
def test_state_dict_through_a_wrapping_override_is_the_wrapped_iterators() -> None:
    def program(loader: Any) -> tuple[list[list[int]], list[list[int]]]:
        iterator = iter(loader)
        head = [next(iterator)[0].tolist() for _ in range(2)]
        state = loader.state_dict()
        again = _observing_loader("ferry", "wrap")(_data("ferry"), batch_size=3, shuffle=True)
        again.load_state_dict(state)
        return head, _plain(again)

    gen = torch.Generator()
    plain = ferry.DataLoader(_data("ferry"), batch_size=3, shuffle=True, generator=gen)
    wrapped = _observing_loader("ferry", "wrap")(
        _data("ferry"), batch_size=3, shuffle=True, generator=gen
    )
    torch.manual_seed(1)
    gen.manual_seed(3)
    want = program(plain)
    torch.manual_seed(1)
    gen.manual_seed(3)
    assert program(wrapped) == want


# -- CombinedLoader pickled mid-epoch -----------------------------------------------------------

MODES = ["min_size", "max_size_cycle", "max_size", "sequential"]


def _combined(impl: str, mode: str) -> CombinedLoader:
    mod = IMPLS[impl]
    return CombinedLoader(
        {
            "inline": mod.DataLoader(_data(impl, 7), batch_size=2),
            "workers": mod.DataLoader(
                _data(impl, 11), batch_size=3, num_workers=2, multiprocessing_context="fork"
            ),
        },
        mode,
    )


def _flatten(item: Any) -> Any:
    if isinstance(item, torch.Tensor):
        return item.tolist()
    if isinstance(item, dict):
        return {k: _flatten(v) for k, v in item.items()}
    if isinstance(item, (list, tuple)):
        return [_flatten(v) for v in item]
    return item


def _pickled_mid_epoch(impl: str, mode: str) -> dict[str, Any]:
    combined = _combined(impl, mode)
    iterator = iter(combined)
    head = [_flatten(next(iterator)) for _ in range(2)]
    data = pickle.dumps(combined)  # raised NotImplementedError when ferry's iterators were not
    rest = [_flatten(item) for item in iterator]  # torch's type
    copy = pickle.loads(data)
    again = [_flatten(item) for item in copy]
    return {"head": head, "rest": rest, "copy": again}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_combined_loader_pickles_mid_epoch_and_goes_on(mode: str) -> None:
    want = _pickled_mid_epoch("torch", mode)
    assert want["rest"]
    assert _pickled_mid_epoch("ferry", mode) == want


def test_iterators_pickle_as_torchs_do_not() -> None:
    for impl, mod in IMPLS.items():
        iterator = iter(mod.DataLoader(_data(impl)))
        with pytest.raises(NotImplementedError, match="cannot be pickled"):
            pickle.dumps(iterator)
