"""What is particular to thread workers: nothing is pickled or copied, they live in this
process, and they can run next to process workers."""

from __future__ import annotations

import os
import queue
import threading

import pytest
import torch

import ferry
from _support import datasets as ds
from _support.processes import ferry_threads
from ferry._engine.crew.channels import take

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.timeout(30)
def test_unpicklable_dataset_and_collate_work_with_threads() -> None:
    loader = ferry.DataLoader(
        ds.HoldsLambda(5),
        batch_size=2,
        num_workers=2,
        collate_fn=lambda batch: [x * 10 for x in batch],
        worker_type="thread",
    )
    assert list(loader) == [[0, 10], [20, 30], [40]]


@pytest.mark.timeout(30)
def test_samples_are_not_copied() -> None:
    dataset = ds.Objects(5)
    loader = ferry.DataLoader(
        dataset, batch_size=None, num_workers=2, collate_fn=ds.identity, worker_type="thread"
    )
    got = list(loader)
    assert all(a is b for a, b in zip(got, dataset.objects, strict=True))


@pytest.mark.timeout(30)
def test_workers_are_named_threads_of_this_process() -> None:
    loader = ferry.DataLoader(
        ds.Probe(6, ferry.get_worker_info), batch_size=None, num_workers=3, worker_type="thread"
    )
    iterator = iter(loader)
    first = next(iterator)
    workers = ferry_threads()
    assert sorted(t.name for t in workers) == ["ferry-worker-0", "ferry-worker-1", "ferry-worker-2"]
    rest = list(iterator)
    by_name = {t.name: t.ident for t in workers}
    for sample in [first, *rest]:
        assert sample["thread"] == by_name[f"ferry-worker-{sample['id']}"]
        assert sample["pid"] == os.getpid()


@pytest.mark.timeout(60)
def test_thread_and_process_loaders_side_by_side() -> None:
    threads = ferry.DataLoader(
        ds.Blocks(12, (3,)), batch_size=3, num_workers=2, worker_type="thread"
    )
    processes = ferry.DataLoader(
        ds.Blocks(12, (3,)), batch_size=3, num_workers=2, multiprocessing_context="fork"
    )
    pairs = list(zip(threads, processes, strict=True))
    assert len(pairs) == 4
    for a, b in pairs:
        assert torch.equal(a, b)


@pytest.mark.timeout(30)
def test_many_thread_workers() -> None:
    loader = ferry.DataLoader(ds.Indices(100), batch_size=3, num_workers=8, worker_type="thread")
    assert [v for b in loader for v in b.tolist()] == list(range(100))


@pytest.mark.timeout(60)
def test_the_main_process_polls_thread_workers_without_hanging_on_python_3_10() -> None:
    """The loop the main process runs on its thread workers' outbox: a message taken, then a
    look with no wait. Python 3.10's ``SimpleQueue.get(timeout=0)`` hangs there within tens of
    thousands of rounds (the lock a put() leaves released; see ``channels.take``); ``take``
    must always come back. Run in a thread, so that a hang fails here and not the suite."""
    box: queue.SimpleQueue[int] = queue.SimpleQueue()
    rounds = 200_000
    done: list[int] = []

    def poll() -> None:
        for _ in range(rounds):
            box.put(1)
            assert take(box, 0.0) == 1
            assert take(box, 0.0) is None
        assert take(box, 0.001) is None  # (a timed wait on an empty queue ends too)
        box.put(2)
        assert take(box, 10.0) == 2
        done.append(rounds)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    thread.join(30)
    assert done == [rounds], "take() hung"
