"""The messages that cross with every batch pickle compactly and come back whole."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from ferry._engine.position.keeper import WorkerReport
from ferry._engine.transport.messages import Done
from ferry._engine.work.fetch import Timing


@pytest.mark.timeout(10)
def test_done_comes_back_whole_with_every_field_set() -> None:
    """Every field of Done crosses (one added later too: the round trip lists them all), and
    its timing is a Timing again, as the stats read it."""
    values = {
        "task": 7,
        "payload": b"batch",
        "slabs": (3, 4),
        "report": WorkerReport(12),
        "timing": Timing(0.5, 0.25, 0.125, 4096),
        "outcome": None,
        "empty": True,
        "cpu": 0.75,
        "reads": (1.0, 0.5, 3),
        "memory": 1 << 20,
        "memory_faults": 99,
    }
    assert {field.name for field in dataclasses.fields(Done)} == set(values)
    done = Done(**values)  # type: ignore[arg-type]
    back = pickle.loads(pickle.dumps(done, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == done
    assert type(back) is Done
    assert type(back.timing) is Timing
    assert back.timing.made_s == 0.75
    with pytest.raises(dataclasses.FrozenInstanceError):
        back.task = 8  # type: ignore[misc]


@pytest.mark.timeout(10)
def test_done_pickles_smaller_than_a_dataclass_would() -> None:
    """A plain tuple of its values: no field name crosses with each batch."""
    done = Done(1, b"", (1,), None, Timing(1.0, 2.0, 3.0, 4))
    data = pickle.dumps(done, protocol=pickle.HIGHEST_PROTOCOL)
    assert b"memory_faults" not in data
    assert b"hand_off_bytes" not in data
