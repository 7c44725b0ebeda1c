"""The errors a saved state can raise as it is loaded are ``ferry.errors``' (where users look for
ferry's exceptions), ValueErrors as torch's loaders raise, and still importable where they were
first defined (``ferry._engine.position.cursor``)."""

from __future__ import annotations

import pytest

import ferry
import ferry.errors
from ferry._engine.position import cursor


def test_the_state_errors_are_exported_by_ferry_errors() -> None:
    for name in ("StateMismatch", "MalformedState"):
        assert name in ferry.errors.__all__
        error = getattr(ferry.errors, name)
        assert issubclass(error, ValueError)
        assert getattr(cursor, name) is error  # the old place names the same class


def test_a_state_from_another_loader_raises_state_mismatch() -> None:
    loader = ferry.DataLoader(range(10), batch_size=2)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    with pytest.raises(ferry.errors.StateMismatch, match="does not fit this loader") as raised:
        ferry.DataLoader(range(12), batch_size=2).load_state_dict(state)
    assert "12" in str(raised.value)


@pytest.mark.timeout(60)
def test_a_stream_state_over_another_number_of_workers_raises_state_mismatch() -> None:
    class Stream(ferry.IterableDataset[int]):
        def __iter__(self):  # type: ignore[no-untyped-def]
            info = ferry.get_worker_info()
            workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
            return iter(range(worker, 40, workers))

    loader = ferry.DataLoader(Stream(), batch_size=2, num_workers=2, worker_type="thread")
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = loader.state_dict()
    del iterator
    resumed = ferry.DataLoader(Stream(), batch_size=2, num_workers=1, worker_type="thread")
    with pytest.raises(ferry.errors.StateMismatch, match="num_workers"):
        resumed.load_state_dict(state)


def test_a_damaged_state_raises_malformed_state() -> None:
    loader = ferry.DataLoader(range(10), batch_size=2)
    state = loader.state_dict()
    with pytest.raises(ferry.errors.MalformedState):
        loader.load_state_dict({**state, "format": "something else"})
