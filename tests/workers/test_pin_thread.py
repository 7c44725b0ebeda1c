"""``pin_memory=True`` with workers: batches are pinned in a background thread as they arrive.

This machine has no accelerator, so pinning itself is replaced by a stand-in (a copy that
records which thread made it); what is tested is the machinery around it, which is the same
with a real accelerator:

* every batch is handed out after it went through the pin step, equal to torch's, in torch's
  order, with process and thread workers, persistent or not, in order or not;
* the pinning runs in one thread, ``ferry-pin``, which selects the accelerator device that was
  current in the thread that iterated (a new thread would start on device 0);
* batches that arrived while the user's loop was busy were pinned before the loop asked for
  them (the point of the thread: the copy overlaps the training step);
* an error while pinning a batch is raised at that batch's ``next()``, and iteration goes on;
  a pin that hangs is bounded by the loader's ``timeout``;
* an error found while reading ahead is raised at the next ``next()``, not at the batch
  already there;
* a resumed epoch is not disturbed by batches pinned ahead; the thread is gone when the
  epoch's workers are (the ``no_leftovers`` fixture checks every test);
* ``num_workers=0`` pins in the caller's thread, as torch does.

The real thing (``is_pinned()`` on a GPU) is ``tests/test_loader.py``'s accelerator test and
``examples/gpu_handoff.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import ferry
import ferry._engine.transport.pin as pin_module
import ferry.loader
from _support import datasets as ds
from _support.compare import assert_same
from _support.processes import FAST, Kind, ferry_threads, poll
from _support.resume import assert_resumes_exactly
from _support.torch_versions import needs_torch
from ferry._engine.transport.pin import Pinner

pytestmark = pytest.mark.timeout(60)


class FakePinning:
    """Stands in for an accelerator: "pinning" a tensor copies it and records the copy."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.lock = threading.Lock()
        self.threads: set[str] = set()
        self.pinned: dict[int, float] = {}  # data_ptr of each copy -> when it was made
        self.fail_on: int | None = None  # a tensor whose first element is this fails
        self.hang_on: int | None = None  # ... this hangs until `released` is set
        self.released = threading.Event()
        self.device_chosen_in: list[str] = []  # where the device was read
        self.device_set_in: list[str] = []  # where it was selected

    def pin_tensor(self, tensor: torch.Tensor, device: str) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        first = int(tensor.flatten()[0]) if tensor.numel() else None
        if first is not None and first == self.fail_on:
            raise OSError(f"cannot pin the batch starting at {self.fail_on}")
        if first is not None and first == self.hang_on:
            self.released.wait(30)
        copy = tensor.clone()
        with self.lock:
            self.threads.add(threading.current_thread().name)
            self.pinned[copy.data_ptr()] = time.monotonic()
        return copy

    def device_setter(self) -> Any:
        self.device_chosen_in.append(threading.current_thread().name)
        return lambda: self.device_set_in.append(threading.current_thread().name)

    def was_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in self.pinned


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakePinning:
    pinning = FakePinning()
    monkeypatch.setattr(ferry.loader, "accelerator_available", lambda: True)
    monkeypatch.setattr(pin_module, "_pin_tensor", pinning.pin_tensor)
    monkeypatch.setattr(pin_module, "device_setter", pinning.device_setter)
    return pinning


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)


def _loaders(kind: Kind, **options: Any) -> tuple[Any, Any]:
    common = {"batch_size": 4, "num_workers": 2, **options}
    ours = ferry.DataLoader(ds.Items(30), pin_memory=True, **common, **kind.kwargs)
    theirs = tud.DataLoader(ds.Items(30), **common)
    return ours, theirs


@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="plain"),
        pytest.param({"persistent_workers": True}, id="persistent"),
        pytest.param(
            {"in_order": False},
            id="out-of-order",
            marks=[needs_torch("2.6", "DataLoader(in_order=)")],
        ),
        pytest.param({"shuffle": True}, id="shuffled"),
    ],
)
def test_every_batch_is_pinned_in_the_pin_thread_and_equals_torchs(
    kind: Kind, options: dict[str, Any], fake: FakePinning
) -> None:
    seeded = "shuffle" in options
    for epoch in range(2):
        if seeded:
            torch.manual_seed(epoch)
        ours, theirs = _loaders(kind, **options)
        got = list(ours)
        if seeded:
            torch.manual_seed(epoch)
        expected = list(theirs)
        if options.get("in_order") is False:  # (arrival order may differ: compare as sets)
            got.sort(key=lambda b: int(b["index"][0]))
            expected.sort(key=lambda b: int(b["index"][0]))
        assert_same(expected, got)
        tensors = [t for batch in got for t in _tensors(batch)]
        assert tensors
        assert all(fake.was_pinned(t) for t in tensors)
    assert fake.threads == {"ferry-pin"}
    assert fake.device_chosen_in
    assert set(fake.device_chosen_in) == {"MainThread"}
    assert poll(lambda: set(fake.device_set_in) == {"ferry-pin"}, 5)


@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_batches_are_pinned_while_the_loop_works(kind: Kind, fake: FakePinning) -> None:
    fake.delay = 0.01  # a copy that takes time, as a large batch's does
    loader = ferry.DataLoader(
        ds.Indices(64), batch_size=4, num_workers=2, pin_memory=True, **kind.kwargs
    )
    asked: list[float] = []
    pinned_before_asked = 0
    iterator = iter(loader)
    for _ in range(len(loader)):
        asked.append(time.monotonic())
        batch = next(iterator)
        if fake.pinned[batch.data_ptr()] < asked[-1]:
            pinned_before_asked += 1
        time.sleep(0.05)  # the training step
    # Workers make a batch in microseconds: after the first few, every batch was waiting,
    # already pinned, when the loop came back for it.
    assert pinned_before_asked >= len(loader) // 2, (pinned_before_asked, len(loader))
    assert loader.stats().pin_s < 0.01 * len(loader)  # the loop waited for few copies


@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_an_error_while_pinning_is_raised_at_its_batch_and_iteration_goes_on(
    kind: Kind, fake: FakePinning
) -> None:
    fake.fail_on = 8  # the third batch: [8, 9, 10, 11]
    loader = ferry.DataLoader(
        ds.Indices(20), batch_size=4, num_workers=2, pin_memory=True, **kind.kwargs
    )
    iterator = iter(loader)
    assert [next(iterator).tolist() for _ in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(OSError, match="cannot pin the batch starting at 8"):
        next(iterator)
    assert [b.tolist() for b in iterator] == [[12, 13, 14, 15], [16, 17, 18, 19]]


@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.slow
def test_a_hung_pin_is_bounded_by_the_loaders_timeout(kind: Kind, fake: FakePinning) -> None:
    # (Batches are pinned in the order they arrive, so a hang holds up those behind it: hang
    # on the first, which arrives before any other is asked for.)
    fake.hang_on = 0
    loader = ferry.DataLoader(
        ds.Indices(20), batch_size=4, num_workers=2, timeout=1, pin_memory=True, **kind.kwargs
    )
    iterator = iter(loader)
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="DataLoader timed out after 1 seconds") as info:
            next(iterator)
        assert time.monotonic() - started < 10
        assert isinstance(info.value, ferry.errors.WorkerTimeout)
        assert "waiting for the pin_memory thread to pin batch 0" in str(info.value)
        with pytest.raises(StopIteration):
            next(iterator)  # the iterator is over: a hung pin is not waited for again
    finally:
        fake.released.set()


@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_an_error_found_while_reading_ahead_is_the_next_batchs(
    kind: Kind, fake: FakePinning, monkeypatch: pytest.MonkeyPatch
) -> None:
    loader = ferry.DataLoader(
        ds.Indices(40), batch_size=4, num_workers=2, pin_memory=True, **kind.kwargs
    )
    iterator = iter(loader)
    assert next(iterator).tolist() == [0, 1, 2, 3]
    poll_for = iterator._poll

    def failing_poll(wait_for: float) -> Any:
        schedule = iterator._schedule
        upcoming = schedule.tasks.get(schedule.next_yield)
        if upcoming is not None and upcoming.arrived:  # reading ahead
            raise RuntimeError("the pipe broke while reading ahead")
        return poll_for(wait_for)

    monkeypatch.setattr(iterator, "_poll", failing_poll)
    assert next(iterator).tolist() == [4, 5, 6, 7]  # already there: handed out
    with pytest.raises(RuntimeError, match="the pipe broke while reading ahead"):
        next(iterator)
    assert iterator._crew.closed  # the workers and the pin thread were stopped
    with pytest.raises(StopIteration):
        next(iterator)  # raised once, then the iterator is over


@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_a_resumed_epoch_ignores_batches_pinned_ahead(kind: Kind, fake: FakePinning) -> None:
    def loader() -> Any:
        return ferry.DataLoader(
            ds.Indices(48),
            batch_size=4,
            shuffle=True,
            generator=torch.Generator().manual_seed(5),
            num_workers=2,
            pin_memory=True,
            **kind.kwargs,
        )

    def pinned_ahead(first: Any) -> None:
        time.sleep(0.2)  # the rest of the prefetched batches arrive and are pinned ahead

    assert_resumes_exactly(lambda seed: loader(), at=5, round_trip=None, before_state=pinned_ahead)


@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_persistent_workers_follow_pin_memory_set_between_epochs(
    kind: Kind, fake: FakePinning
) -> None:
    loader = ferry.DataLoader(
        ds.Indices(12), batch_size=4, num_workers=2, persistent_workers=True, **kind.kwargs
    )
    for pin in (False, True, False):
        loader.pin_memory = pin
        fake.pinned.clear()
        batches = list(loader)
        assert [fake.was_pinned(b) for b in batches] == [pin] * 3
        alive = [t for t in ferry_threads() if t.name == "ferry-pin" and t.is_alive()]
        assert len(alive) == int(pin)


def test_without_workers_the_batch_is_pinned_in_the_callers_thread(fake: FakePinning) -> None:
    loader = ferry.DataLoader(ds.Indices(10), batch_size=5, pin_memory=True)
    batches = list(loader)
    assert all(fake.was_pinned(b) for b in batches)
    assert fake.threads == {"MainThread"}
    assert not [t for t in ferry_threads() if t.name == "ferry-pin"]


# -- the Pinner alone ----------------------------------------------------------------------------


def test_pinner_hands_out_in_submission_order_and_stops_its_thread(fake: FakePinning) -> None:
    pinner = Pinner()
    jobs = [pinner.submit(torch.full((3,), i)) for i in range(20)]
    assert [job.take().tolist() for job in jobs] == [[i] * 3 for i in range(20)]
    pinner.close()
    assert not pinner.thread.is_alive()


def test_a_batch_left_when_the_pinner_closes_is_pinned_by_its_taker(fake: FakePinning) -> None:
    fake.delay = 0.05
    pinner = Pinner()
    jobs = [pinner.submit(torch.full((2,), i)) for i in range(10)]
    pinner.close()  # after the batch in progress, nothing more is pinned by the thread
    assert not pinner.thread.is_alive()
    late = pinner.submit(torch.full((2,), 10))
    assert [job.take().tolist() for job in [*jobs, late]] == [[i] * 2 for i in range(11)]
    assert "MainThread" in fake.threads


def test_a_device_that_cannot_be_selected_fails_each_batch_clearly(
    fake: FakePinning, monkeypatch: pytest.MonkeyPatch
) -> None:
    def setter() -> Any:
        def fail() -> None:
            raise RuntimeError("CUDA error: invalid device ordinal")

        return fail

    monkeypatch.setattr(pin_module, "device_setter", setter)
    pinner = Pinner()
    try:
        job = pinner.submit(torch.zeros(2))
        with pytest.raises(RuntimeError, match="could not select the accelerator device") as info:
            job.take()
        assert "invalid device ordinal" in str(info.value.__cause__)
    finally:
        pinner.close()
