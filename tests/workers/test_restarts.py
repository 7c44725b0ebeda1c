"""Replacing dead worker processes: ``DataLoader(..., max_worker_restarts=N)``.

A worker process that dies (SIGKILL, a segfault, abort) is replaced by a new one that starts
where the dead one's last delivered batch left it (its position in its stream, its dataset's
state, its random generators), and fetches the dead one's unfinished batches again, in order:
the epoch's batches are exactly those of an undisturbed run, random augmentations included.
Each restart warns :class:`ferry.errors.WorkerRestartWarning`; past the limit (counted per
iterator) the loader raises :class:`ferry.errors.WorkerDied` as it does by default (0).

The oracle is always the same loader, built the same way with the same seeded generator, run
without any death. Workers die either by their own hand (the dataset dies at chosen indices,
once each: see :mod:`workers.restart_datasets`) or killed by the test (``os.kill``).
"""

from __future__ import annotations

import gc
import os
import re
import signal
import warnings
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import ferry
from _support.compare import canon
from _support.processes import exited, poll, reaped, worker_pids
from ferry.errors import WorkerDied, WorkerRestartWarning
from workers import restart_datasets as rd

SEED = 1234
NOTICE = 5.0
"""Generous seconds within which an exited process must be gone."""


# -- helpers -------------------------------------------------------------------------------------


def make_loader(dataset: Any, **options: Any) -> ferry.DataLoader[Any]:
    """A 2-worker (fork) loader over ``dataset`` with a freshly seeded generator, so that two
    loaders made alike draw the same shuffles and worker seeds."""
    options = {
        "batch_size": 2,
        "num_workers": 2,
        "multiprocessing_context": "fork",
        "generator": torch.Generator().manual_seed(SEED),
        **options,
    }
    return ferry.DataLoader(dataset, **options)


def run(batches: Any) -> list[Any]:
    """Every batch of an iterable (an epoch), exactly described (see ``canon``)."""
    return [canon(batch) for batch in batches]


def indices_of(epoch: list[Any]) -> list[list[int]]:
    """The sample indices (stream items) of each batch of a run: its first field."""
    return [list(batch[1][0][3]) for batch in epoch]


class Recorded:
    """``with Recorded() as caught``: every warning, recorded (``caught.restarts``: the
    messages of restart warnings)."""

    def __enter__(self) -> Recorded:
        self._context = warnings.catch_warnings(record=True)
        self.all = self._context.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc: object) -> None:
        self._context.__exit__(*exc)

    @property
    def restarts(self) -> list[str]:
        return [str(w.message) for w in self.all if issubclass(w.category, WorkerRestartWarning)]


def children() -> set[int]:
    """Pids of every process below this one (zombies included)."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


# -- the epoch goes on unchanged -----------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", rd.HOW)
def test_worker_that_dies_is_replaced_and_the_epoch_is_unchanged(how: str, tmp_path: Path) -> None:
    """A worker that dies while fetching (SIGKILL, segfault, abort()) is replaced; with
    shuffling and random augmentation in ``__getitem__``, the epoch's batches are those of an
    undisturbed run, in the same order, and one restart warning names the signal."""
    expected = run(make_loader(rd.Augmented(24), shuffle=True))
    dataset = rd.Augmented(24, die_at=[11], marker=str(tmp_path / "died"), how=how)
    with Recorded() as caught:
        got = run(make_loader(dataset, shuffle=True, max_worker_restarts=1))
    assert got == expected
    assert len(caught.restarts) == 1, caught.restarts
    signal_name = {"kill": "SIGKILL", "segv": "SIGSEGV", "abort": "SIGABRT"}[how]
    assert signal_name in caught.restarts[0]
    assert "restart 1 of max_worker_restarts=1" in caught.restarts[0]


@pytest.mark.timeout(60)
def test_worker_killed_from_outside_is_replaced_and_the_epoch_is_unchanged() -> None:
    """The test SIGKILLs a busy worker after some batches: the old process is gone (reaped),
    a new one with another pid takes its place and the epoch's batches are unchanged."""
    dataset = rd.Augmented(30, delay=0.01)
    expected = run(make_loader(dataset, shuffle=True))
    loader = make_loader(dataset, shuffle=True, max_worker_restarts=1)
    with Recorded() as caught:
        iterator = iter(loader)
        got = [canon(next(iterator)) for _ in range(3)]
        old = worker_pids(iterator)
        old_handle = iterator._workers[1]
        os.kill(old[1], signal.SIGKILL)
        got += run(iterator)
    assert got == expected
    assert len(caught.restarts) == 1, caught.restarts
    new = worker_pids(iterator)
    assert new[0] == old[0]
    assert new[1] != old[1]
    assert f"worker 1 (pid {old[1]})" in caught.restarts[0]
    assert f"(pid {new[1]};" in caught.restarts[0]
    assert not old_handle.is_alive()
    assert poll(lambda: reaped(old[1]), NOTICE), "the dead worker was not collected"


@pytest.mark.timeout(60)
def test_replacement_also_works_with_in_order_false(tmp_path: Path) -> None:
    """With ``in_order=False`` batches go to whichever worker is free, so neither their order
    nor which worker draws which augmentation is fixed; the epoch still holds the very batches
    (same indices) of an undisturbed run, each once, the dead worker's included."""
    expected = indices_of(run(make_loader(rd.Augmented(24), shuffle=True, in_order=False)))
    dataset = rd.Augmented(24, die_at=[7], marker=str(tmp_path / "died"))
    with Recorded() as caught:
        got = run(make_loader(dataset, shuffle=True, in_order=False, max_worker_restarts=1))
    assert sorted(indices_of(got)) == sorted(expected)
    assert len(caught.restarts) == 1


@pytest.mark.timeout(60)
def test_replacement_also_works_with_balanced_workers(tmp_path: Path) -> None:
    """With ``balance_workers=True`` which worker makes a batch depends on timing, so its
    augmentation is not fixed; the batches (same indices) still come in the undisturbed order,
    the dead worker's included."""
    expected = indices_of(run(make_loader(rd.Augmented(24), shuffle=True)))
    dataset = rd.Augmented(24, die_at=[7], marker=str(tmp_path / "died"))
    with Recorded() as caught:
        got = run(make_loader(dataset, shuffle=True, balance_workers=True, max_worker_restarts=1))
    assert indices_of(got) == expected
    assert len(caught.restarts) == 1


@pytest.mark.timeout(60)
def test_dataset_state_of_a_map_style_dataset_is_restored(tmp_path: Path) -> None:
    """A map-style dataset with ``state_dict``/``load_state_dict`` (a per-worker fetch count
    in each sample): the replacement continues the dead worker's count, not from zero."""
    expected = run(make_loader(rd.Counted(24), shuffle=True))
    dataset = rd.Counted(24, die_at=[13], marker=str(tmp_path / "died"))
    with Recorded() as caught:
        got = run(make_loader(dataset, shuffle=True, max_worker_restarts=1))
    assert got == expected
    assert len(caught.restarts) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("state", list(rd.STREAMS))
@pytest.mark.parametrize("die_at", [1, 12], ids=["first-item", "mid-stream"])
def test_stream_worker_is_replaced_at_its_position(state: str, die_at: int, tmp_path: Path) -> None:
    """An iterable-style dataset sharded by ``get_worker_info``, whose position is kept
    nowhere (the replacement reads its share again and drops what was delivered), on its
    iterator, or on the dataset: the replacement goes on from the dead worker's position
    with the same random draws, whether it died before its first batch or mid-stream."""
    stream = rd.STREAMS[state]
    expected = run(make_loader(stream(22), batch_size=3))
    dataset = stream(22, die_at=[die_at], marker=str(tmp_path / "died"))
    with Recorded() as caught:
        got = run(make_loader(dataset, batch_size=3, max_worker_restarts=1))
    assert got == expected
    assert len(caught.restarts) == 1
    assert "the next batch of its dataset stream" in caught.restarts[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("kind", "die_at", "epoch"),
    [
        ("map", 0, 2),  # index 0: worker 0's first batch of epoch 2
        ("shuffled", 9, 1),
        ("shuffled", 9, 2),
        ("none", 0, 2),  # item 0: worker 0's first item of epoch 2
        ("none", 8, 1),
        ("none", 8, 2),
        ("iterator", 8, 2),
        ("dataset", 8, 2),
    ],
)
def test_persistent_workers_are_replaced_in_either_epoch(
    kind: str, die_at: int, epoch: int, tmp_path: Path
) -> None:
    """With ``persistent_workers=True`` a worker that dies in epoch 1 or 2 (at its first
    batch of the epoch, or later) is replaced there: both epochs equal an undisturbed run's,
    including the random draws, which persistent workers carry from one epoch to the next
    (after a death in epoch 1, the replacement serves epoch 2)."""

    def dataset(**options: Any) -> Any:
        if kind in ("map", "shuffled"):
            return rd.Augmented(20, **options)
        return rd.STREAMS[kind](20, **options)

    shuffle = {"shuffle": kind == "shuffled"}
    reference = make_loader(dataset(), persistent_workers=True, **shuffle)
    expected = [run(reference), run(reference)]
    del reference
    arm = tmp_path / "armed"
    loader = make_loader(
        dataset(die_at=[die_at], marker=str(tmp_path / "died"), arm=str(arm)),
        persistent_workers=True,
        max_worker_restarts=1,
        **shuffle,
    )
    with Recorded() as caught:
        if epoch == 1:
            arm.touch()
        first = run(loader)
        assert len(caught.restarts) == (epoch == 1)
        arm.touch()
        second = run(loader)
    assert [first, second] == expected
    assert len(caught.restarts) == 1, caught.restarts


@pytest.mark.timeout(60)
def test_persistent_worker_that_died_between_epochs_is_replaced() -> None:
    """A persistent worker killed while idle between epochs (as the OOM killer might) is
    replaced when the next epoch begins, and that epoch is unchanged."""
    reference = make_loader(rd.Augmented(12), persistent_workers=True)
    expected = [run(reference), run(reference)]
    del reference
    loader = make_loader(rd.Augmented(12), persistent_workers=True, max_worker_restarts=1)
    try:
        first = run(loader)
        pid = loader._iterator._workers[0].pid
        os.kill(pid, signal.SIGKILL)
        assert poll(lambda: exited(pid), NOTICE)
        with Recorded() as caught:
            second = run(loader)
        assert [first, second] == expected
        assert len(caught.restarts) == 1
    finally:
        loader._iterator = None  # stops the workers (the error's traceback holds the iterator)


@pytest.mark.timeout(60)
def test_persistent_worker_that_died_between_epochs_raises_worker_died_by_default() -> None:
    """Without restarts, a persistent worker killed between epochs is reported as torch
    reports it: the next epoch raises WorkerDied ("exited unexpectedly"), not a pipe error."""
    loader = make_loader(rd.Augmented(12), persistent_workers=True)
    try:
        run(loader)
        pid = loader._iterator._workers[0].pid
        os.kill(pid, signal.SIGKILL)
        assert poll(lambda: exited(pid), NOTICE)
        with pytest.raises(WorkerDied, match="exited unexpectedly"):
            run(loader)
    finally:
        loader._iterator = None  # stops the workers (the error's traceback holds the iterator)


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_replacement_with_spawn(tmp_path: Path) -> None:
    """Under the spawn start method too, the replacement is started (and the dataset pickled
    to it) and the epoch equals an undisturbed run (worker seeds do not depend on the start
    method, so the oracle uses fork)."""
    expected = run(make_loader(rd.Augmented(12), shuffle=True))
    dataset = rd.Augmented(12, die_at=[5], marker=str(tmp_path / "died"))
    with Recorded() as caught:
        got = run(
            make_loader(
                dataset, shuffle=True, max_worker_restarts=1, multiprocessing_context="spawn"
            )
        )
    assert got == expected
    assert len(caught.restarts) == 1


@pytest.mark.timeout(60)
def test_both_workers_killed_at_once_are_both_replaced() -> None:
    """Every worker SIGKILLed at the same moment, with ``max_worker_restarts=2``: both are
    replaced (two warnings) and the epoch is unchanged."""
    dataset = rd.Augmented(24, delay=0.01)
    expected = run(make_loader(dataset, shuffle=True))
    with Recorded() as caught:
        iterator = iter(make_loader(dataset, shuffle=True, max_worker_restarts=2))
        got = [canon(next(iterator)) for _ in range(2)]
        old = worker_pids(iterator)
        for pid in old:
            os.kill(pid, signal.SIGKILL)
        got += run(iterator)
    assert got == expected
    assert len(caught.restarts) == 2, caught.restarts
    died = sorted(re.findall(r"exited unexpectedly: (worker \d) \(pid", " ".join(caught.restarts)))
    assert died == ["worker 0", "worker 1"], caught.restarts
    assert set(worker_pids(iterator)).isdisjoint(old)


@pytest.mark.timeout(60)
def test_the_same_worker_dying_twice_is_replaced_twice(tmp_path: Path) -> None:
    """Indices 6 and 14 are both worker 1's (batches 3 and 7): the worker and then its
    replacement die; with ``max_worker_restarts=2`` both are replaced, the warnings count
    "restart 1 of" and "restart 2 of", and the epoch is unchanged."""
    expected = run(make_loader(rd.Augmented(20)))
    dataset = rd.Augmented(20, die_at=[6, 14], marker=str(tmp_path / "died"))
    with Recorded() as caught:
        got = run(make_loader(dataset, max_worker_restarts=2))
    assert got == expected
    assert len(caught.restarts) == 2
    assert "worker 1 (pid " in caught.restarts[0]
    assert "worker 1 (pid " in caught.restarts[1]
    assert "restart 1 of max_worker_restarts=2" in caught.restarts[0]
    assert "restart 2 of max_worker_restarts=2" in caught.restarts[1]


@pytest.mark.timeout(60)
def test_worker_init_fn_runs_in_the_replacement(tmp_path: Path) -> None:
    """The replacement is set up like the worker it replaces: ``worker_init_fn`` runs in it
    with the same worker id (its samples carry what the function set), before the dead
    worker's random generators are restored."""
    expected = run(make_loader(rd.Tagged(16), shuffle=True, worker_init_fn=rd.tag_worker))
    dataset = rd.Tagged(16, die_at=[9], marker=str(tmp_path / "died"))
    with Recorded() as caught:
        got = run(
            make_loader(dataset, shuffle=True, worker_init_fn=rd.tag_worker, max_worker_restarts=1)
        )
    assert got == expected
    assert len(caught.restarts) == 1


# -- the limit -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_restarts_past_the_limit_raise_worker_died(tmp_path: Path) -> None:
    """``max_worker_restarts=1`` and two deaths: the first is replaced (batches so far are the
    undisturbed run's), the second raises WorkerDied, with torch's words first and a note
    saying how many restarts were used."""
    expected = run(make_loader(rd.Augmented(24)))
    dataset = rd.Augmented(24, die_at=[6, 15], marker=str(tmp_path / "died"))
    got: list[Any] = []
    with Recorded() as caught, pytest.raises(WorkerDied) as raised:
        got.extend(canon(batch) for batch in make_loader(dataset, max_worker_restarts=1))
    assert len(caught.restarts) == 1
    assert got == expected[: len(got)]
    assert len(got) <= 7  # index 15 is in batch 7
    error = raised.value
    assert isinstance(error, RuntimeError)
    assert str(error).startswith("DataLoader worker (pid(s) ")
    assert "SIGKILL" in str(error)
    assert "indices [14, 15]" in str(error)
    assert "(max_worker_restarts=1: 1 restarts used)" in getattr(error, "__notes__", [])


@pytest.mark.timeout(60)
def test_by_default_a_dead_worker_raises_worker_died(tmp_path: Path) -> None:
    """The default (``max_worker_restarts=0``) keeps torch's behaviour: the first death
    raises WorkerDied, with no restart warning and no note about restarts."""
    dataset = rd.Augmented(12, die_at=[4], marker=str(tmp_path / "died"))
    with Recorded() as caught, pytest.raises(WorkerDied) as raised:
        run(make_loader(dataset))
    assert not caught.restarts
    assert str(raised.value).startswith("DataLoader worker (pid(s) ")
    assert "indices [4, 5]" in str(raised.value)
    assert not any("max_worker_restarts" in n for n in getattr(raised.value, "__notes__", []))


@pytest.mark.timeout(60)
def test_restarts_are_counted_per_iterator(tmp_path: Path) -> None:
    """``max_worker_restarts=1`` allows one restart per iterator: a loader without persistent
    workers gets a new iterator each epoch, so one death in each of two epochs is fine."""
    dataset = rd.Augmented(16, delay=0.01)
    reference = make_loader(dataset, shuffle=True)
    expected = [run(reference), run(reference)]
    loader = make_loader(
        rd.Augmented(16, delay=0.01, die_at=[3], marker=str(tmp_path / "died")),
        shuffle=True,
        max_worker_restarts=1,
    )
    with Recorded() as caught:
        first = run(loader)
        iterator = iter(loader)
        second = [canon(next(iterator))]
        os.kill(worker_pids(iterator)[0], signal.SIGKILL)
        second += run(iterator)
    assert [first, second] == expected
    assert len(caught.restarts) == 2
    assert all("restart 1 of max_worker_restarts=1" in m for m in caught.restarts)


@pytest.mark.timeout(60)
def test_with_persistent_workers_one_budget_spans_the_epochs(tmp_path: Path) -> None:
    """Persistent workers keep one iterator across epochs, so restarts are counted across
    epochs too: with ``max_worker_restarts=1`` a death in epoch 1 uses the budget, and a
    death in epoch 2 raises WorkerDied, noting the restart already used."""
    dataset = rd.Augmented(12, die_at=[3], marker=str(tmp_path / "died"))
    loader = make_loader(dataset, persistent_workers=True, max_worker_restarts=1)
    with Recorded() as caught:
        run(loader)  # index 3 kills its worker: restart 1 of 1
        assert len(caught.restarts) == 1
        (tmp_path / "died.3").unlink()  # index 3 kills its worker once more, in epoch 2
        with pytest.raises(WorkerDied) as raised:
            run(loader)
    assert len(caught.restarts) == 1
    assert "(max_worker_restarts=1: 1 restarts used)" in getattr(raised.value, "__notes__", [])


@pytest.mark.timeout(60)
def test_thread_workers_are_never_restarted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread worker ends only through a bug of ferry's: it is reported as WorkerDied even
    with restarts allowed (simulated by a worker thread that returns at once, holding tasks)."""
    from ferry._engine.crew import group

    def vanish(*args: Any, **kwargs: Any) -> None:
        return None

    monkeypatch.setattr(group, "thread_worker_main", vanish)
    loader = make_loader(rd.Augmented(8), worker_type="thread", max_worker_restarts=3)
    with Recorded() as caught, pytest.raises(WorkerDied):
        run(loader)
    assert not caught.restarts


# -- what the user sees ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_restart_warning_says_who_died_how_and_what_replaced_it(tmp_path: Path) -> None:
    """The warning is a UserWarning carrying the WorkerDied text (worker id, old pid, signal,
    indices in flight), the new pid and the restart count against the limit; it points at
    the user's loop."""
    dataset = rd.Augmented(16, die_at=[8], marker=str(tmp_path / "died"))
    loader = make_loader(dataset, max_worker_restarts=2)
    iterator = iter(loader)
    old = worker_pids(iterator)
    with pytest.warns(WorkerRestartWarning) as caught:
        got = run(iterator)  # (the line the warning points at)
    assert indices_of(got) == [[2 * i, 2 * i + 1] for i in range(8)]
    assert issubclass(WorkerRestartWarning, UserWarning)
    # (Python >= 3.12 also warns, DeprecationWarning, at a fork while other threads run)
    restarts = [w for w in caught if issubclass(w.category, WorkerRestartWarning)]
    assert len(restarts) == 1
    message = str(restarts[0].message)
    new = worker_pids(iterator)
    assert message.startswith(f"DataLoader worker (pid(s) {old[0]}) exited unexpectedly")
    assert f"worker 0 (pid {old[0]}) was killed by signal SIGKILL" in message
    assert "indices [8, 9]" in message  # batch 4, the one it died fetching
    assert f"replaced by a new worker process (pid {new[0]}; restart 1 of " in message
    assert "max_worker_restarts=2" in message
    assert re.search(r"fetches its \d+ unfinished batches again", message), message
    assert restarts[0].filename == __file__


@pytest.mark.timeout(60)
def test_no_process_is_left_behind_after_a_restart(tmp_path: Path) -> None:
    """Right after the restart the dead worker is collected (not a zombie) and the new one
    runs; once the loader is gone, no process it started is left."""
    before = children()
    dataset = rd.Augmented(20, die_at=[6], marker=str(tmp_path / "died"))
    loader = make_loader(dataset, max_worker_restarts=1)
    iterator = iter(loader)
    old = worker_pids(iterator)
    old_handles = list(iterator._workers)
    with Recorded() as caught:
        # Index 6 is in batch 3, worker 1's: it was replaced before batch 3 came.
        for _ in range(6):
            next(iterator)
    assert len(caught.restarts) == 1
    new = worker_pids(iterator)
    assert new[0] == old[0]
    assert new[1] != old[1]
    assert not old_handles[1].is_alive()
    assert iterator._workers[0].is_alive()
    assert iterator._workers[1].is_alive()
    assert poll(lambda: reaped(old[1]), NOTICE)
    assert children() - before == {new[0], new[1]}
    del iterator, loader
    gc.collect()
    assert poll(lambda: not children() - before, NOTICE), children() - before


# -- resuming after a restart --------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["map", "none", "iterator"])
def test_state_dict_taken_after_a_restart_resumes_identically(kind: str, tmp_path: Path) -> None:
    """``loader.state_dict()`` taken after a restart, loaded into a fresh loader, continues
    with exactly the rest of the undisturbed run (the replacement's position and random
    generators are part of the state)."""

    def dataset(**options: Any) -> Any:
        if kind == "map":
            return rd.Augmented(24, **options)
        return rd.STREAMS[kind](24, **options)

    shuffle = {"shuffle": True} if kind == "map" else {}
    expected = run(make_loader(dataset(), **shuffle))
    # Two batches past the one holding index (or item) 5, whose fetch kills its worker.
    cut = next(n for n, batch in enumerate(indices_of(expected)) if 5 in batch) + 2
    loader = make_loader(
        dataset(die_at=[5], marker=str(tmp_path / "died")), max_worker_restarts=1, **shuffle
    )
    with Recorded() as caught:
        iterator = iter(loader)
        head = [canon(next(iterator)) for _ in range(cut)]
        state = loader.state_dict()
    assert len(caught.restarts) == 1
    del iterator
    fresh = make_loader(dataset(), **shuffle)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (a stateless stream is replayed)
        fresh.load_state_dict(state)
        tail = run(fresh)
    assert head + tail == expected


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["map", *rd.STREAMS])
def test_worker_dying_right_after_a_resume_restarts_at_the_resumed_position(
    kind: str, tmp_path: Path
) -> None:
    """A loader resumed from a state mid-epoch whose workers die at their very first fetch
    (they never delivered a batch, so the position to restart from is the loaded state's):
    the rest of the epoch is still exactly the undisturbed run's."""

    def dataset(**options: Any) -> Any:
        if kind == "map":
            return rd.Augmented(24, **options)
        return rd.STREAMS[kind](24, **options)

    shuffle = {"shuffle": True} if kind == "map" else {}
    expected = run(make_loader(dataset(), batch_size=3, **shuffle))
    cut = 3
    first = make_loader(dataset(), batch_size=3, **shuffle)
    iterator = iter(first)
    head = [canon(next(iterator)) for _ in range(cut)]
    state = first.state_dict()
    del iterator, first
    # The first sample each worker fetches after the cut: batch 3 is worker 1's, 4 worker 0's.
    after = indices_of(expected)
    die_at = [after[cut][0], after[cut + 1][0]]
    resumed = make_loader(
        dataset(die_at=die_at, marker=str(tmp_path / "died")),
        batch_size=3,
        max_worker_restarts=2,
        **shuffle,
    )
    with Recorded() as caught:
        resumed.load_state_dict(state)
        tail = run(resumed)
    assert head + tail == expected
    assert len(caught.restarts) == 2, caught.restarts
