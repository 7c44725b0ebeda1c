"""Stall reports: ``DataLoader(..., stall_warning=SECONDS)`` (default 300, None: off).

When the training loop has waited ``stall_warning`` seconds for a batch, the loader warns
once (:class:`ferry.errors.StallWarning`, a UserWarning) with what each worker holding
unfinished batches is doing: its id and pid, the batch it is fetching (indices, or "the next
batch of its dataset stream") and for how long, the batches queued behind it, and the Python
stack of its main thread. Training goes on: every batch still arrives, unchanged. Only loaders
with workers report; ``timeout`` still raises.

Stalls are made by a dataset that sleeps at chosen indices (``slow``); durations in messages
are checked against generous bounds only.
"""

from __future__ import annotations

import inspect
import math
import os
import re
import warnings
from typing import Any

import pytest
import torch

import ferry
from _support.compare import canon, stable_id
from ferry.errors import StallWarning, WorkerTimeout
from workers import restart_datasets as rd

SEED = 99
LIMIT = 0.4
"""The stall_warning (seconds) of the tests that stall on purpose."""
STUCK = 1.5
"""How long a stalled fetch sleeps: well past LIMIT plus the loop's half-second wait slice."""

WORKER_TYPES = ["process", "thread"]


# -- helpers -------------------------------------------------------------------------------------


def make_loader(dataset: Any, **options: Any) -> ferry.DataLoader[Any]:
    """A 2-worker loader over ``dataset`` (batches of 2, a seeded generator)."""
    options = {
        "batch_size": 2,
        "num_workers": 2,
        "generator": torch.Generator().manual_seed(SEED),
        "stall_warning": LIMIT,
        **options,
    }
    return ferry.DataLoader(dataset, **options)


def indices_of(batches: list[Any]) -> list[list[int]]:
    """The sample indices (stream items) of each batch: its first field."""
    return [batch[0].tolist() for batch in batches]


def epoch_with_warnings(loader: Any) -> tuple[list[Any], list[str]]:
    """Every batch of one epoch, and the messages of the stall warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(loader)
    return batches, [str(w.message) for w in caught if issubclass(w.category, StallWarning)]


def durations(message: str, pattern: str) -> list[float]:
    """The seconds written after ``pattern`` (a regex ending where the number starts)."""
    return [float(x) for x in re.findall(pattern + r"(\d+(?:\.\d+)?) s", message)]


# -- the report ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_stall_report_names_the_stuck_worker_its_batches_and_its_stack(
    worker_type: str,
) -> None:
    """Index 5 sleeps: batch 2 (indices [4, 5], worker 0's) stalls. One warning names worker 0
    and its pid, the batch it fetches and for how long, the batch queued behind it, and a
    stack that reaches the user's ``__getitem__`` and its ``time.sleep`` line; it points at the
    training loop, and the epoch goes on with every batch, as without the stall."""
    dataset = rd.Augmented(12, slow={5: STUCK})
    loader = make_loader(dataset, worker_type=worker_type)
    iterator = iter(loader)
    pid = iterator._workers[0].pid
    assert (pid == os.getpid()) == (worker_type == "thread")
    with pytest.warns(StallWarning) as caught:
        batches = list(iterator)  # (the line the warning points at)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert caught[0].filename == __file__
    message = str(caught[0].message)
    assert message.startswith("DataLoader stalled: the training loop has waited ")
    assert "for batch 2 (stall_warning=0.4)" in message
    (waited,) = durations(message, r"the training loop has waited ")
    assert waited >= LIMIT, message  # a sub-second threshold is not rounded to "0 s"
    assert f"worker 0 (pid {pid}): fetching batch 2 (indices [4, 5]) for " in message
    (fetching,) = durations(message, r"fetching batch 2 \(indices \[4, 5\]\) for ")
    assert LIMIT / 2 <= fetching <= 10 * STUCK, message
    # Batch 4 was handed to worker 0 when batch 0 was yielded: it waits behind batch 2.
    assert "    then batch 4 (indices [8, 9]), handed to it " in message
    assert "its stack (most recent call last):" in message
    assert f'File "{rd.__file__}"' in message
    assert "in __getitem__" in message
    assert "time.sleep(self.slow[index])" in message
    assert message.rstrip().endswith("stall_warning=None to silence this report.")
    assert indices_of(batches) == [[2 * i, 2 * i + 1] for i in range(6)]
    if worker_type == "process":  # (threads share one global generator: draws are racy)
        reference = make_loader(rd.Augmented(12), stall_warning=None)
        assert [canon(b) for b in batches] == [canon(b) for b in reference]


@pytest.mark.timeout(60)
def test_stall_report_shows_the_reads_a_thread_worker_runs_on_its_read_pool() -> None:
    """Every read sleeps, so thread workers read a batch's samples at once on their read pool
    and wait for them there: the report also gives the stack of each read in flight for the
    stalled worker, which is where the user's code is (on a loaded machine the pool takes
    reads that only look slow, so the test above met this too, now and then)."""
    dataset = rd.Augmented(12, delay=0.02, slow={5: STUCK})
    loader = make_loader(dataset, worker_type="thread")
    with pytest.warns(StallWarning) as caught:
        batches = list(loader)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "worker 0 (pid " in message
    assert "fetching batch 2 (indices [4, 5])" in message
    worker_part, _, read_part = message.partition(
        "    its read of index 5 on the read pool (most recent call last):\n"
    )
    assert read_part, message
    assert "in _gather" in worker_part, message  # the worker waits on the pool
    assert f'File "{rd.__file__}"' in read_part, message
    assert "in __getitem__" in read_part, message
    assert "time.sleep(self.slow[index])" in read_part, message
    assert "reads.py" not in read_part, message  # (the pool's own frames are left out)
    assert "its read of index 4" not in message, message  # (done before the report)
    assert indices_of(batches) == [[2 * i, 2 * i + 1] for i in range(6)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_stream_stall_names_the_next_batch_of_its_dataset_stream(worker_type: str) -> None:
    """An iterable-style dataset stalls at item 4 (worker 0's second batch: items 4 and 6):
    the report says the worker fetches "the next batch of its dataset stream", its stack
    shows the stream's code, and the whole stream is delivered."""
    loader = make_loader(rd.Stream(12, slow={4: STUCK}), worker_type=worker_type)
    batches, messages = epoch_with_warnings(loader)
    assert len(messages) == 1, messages
    message = messages[0]
    assert "worker 0 (pid " in message
    assert "fetching batch 2 (the next batch of its dataset stream) for " in message
    assert "time.sleep(self.slow[item])" in message
    assert "in make" in message
    assert sorted(i for batch in indices_of(batches) for i in batch) == list(range(12))
    assert indices_of(batches)[2] == [4, 6]


@pytest.mark.timeout(60)
def test_stall_report_with_in_order_false() -> None:
    """With ``in_order=False`` the loop takes whatever is ready; once only the stuck batch is
    left it waits, and the report names the worker fetching indices [4, 5]. Every batch
    arrives."""
    loader = make_loader(rd.Augmented(12, slow={5: STUCK}), in_order=False)
    batches, messages = epoch_with_warnings(loader)
    assert len(messages) == 1, messages
    assert re.search(
        r"worker [01] \(pid \d+\): fetching batch 2 \(indices \[4, 5\]\) for \d", messages[0]
    ), messages[0]
    assert sorted(indices_of(batches)) == [[2 * i, 2 * i + 1] for i in range(6)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_stall_in_worker_init_fn_shows_each_worker_still_starting(worker_type: str) -> None:
    """Both workers spend 1.5 s in ``worker_init_fn`` before their first batch: the report
    lists both, each "still starting" (not fetching), with its first batches queued and a
    stack showing the ``worker_init_fn`` line it is in."""
    loader = make_loader(rd.Augmented(8), worker_type=worker_type, worker_init_fn=rd.slow_init)
    batches, messages = epoch_with_warnings(loader)
    assert len(messages) == 1, messages
    message = messages[0]
    assert "for batch 0 (stall_warning=0.4)" in message
    for worker_id, first in ((0, "[0, 1]"), (1, "[2, 3]")):
        assert re.search(
            rf"worker {worker_id} \(pid \d+\): still starting, \d+\.\d s after it was started "
            r"\(in worker_init_fn or opening its dataset: see its stack\)\n"
            rf"    then batch {worker_id} \(indices {re.escape(first)}\), handed to it ",
            message,
        ), message
    assert message.count("in slow_init") == 2, message
    assert "time.sleep(INIT_SECONDS)" in message
    assert indices_of(batches) == [[2 * i, 2 * i + 1] for i in range(4)]


@pytest.mark.timeout(60)
def test_stall_while_a_spawn_worker_starts_says_it_is_starting() -> None:
    """A spawn worker cannot answer while its interpreter starts and unpickles the dataset
    (2 s here, whatever the machine's speed): the report says it is still starting, not that
    it did not answer."""
    loader = make_loader(rd.SlowToUnpickle(4, 2.0), num_workers=1, multiprocessing_context="spawn")
    batches, messages = epoch_with_warnings(loader)
    assert len(messages) == 1, messages
    message = messages[0]
    assert re.search(r"worker 0 \(pid \d+\): still starting, \d+\.\d s after", message), message
    assert "imports the main module and unpickles the dataset" in message, message
    assert "did not answer" not in message, message
    assert [batch.tolist() for batch in batches] == [[0, 1], [2, 3]]


# -- once per stall --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_two_separate_stalls_give_two_warnings(worker_type: str) -> None:
    """Indices 3 and 13 sleep: batch 1 (worker 1) and batch 6 (worker 0) stall, apart. Each
    stall is reported once, naming its own batch; a long stall is not reported again and
    again (each lasts several times ``stall_warning``)."""
    loader = make_loader(rd.Augmented(16, slow={3: STUCK, 13: STUCK}), worker_type=worker_type)
    batches, messages = epoch_with_warnings(loader)
    assert len(messages) == 2, messages
    assert "worker 1 (pid " in messages[0]
    assert "fetching batch 1 (indices [2, 3])" in messages[0]
    assert "worker 0 (pid " in messages[1]
    assert "fetching batch 6 (indices [12, 13])" in messages[1]
    assert indices_of(batches) == [[2 * i, 2 * i + 1] for i in range(8)]


# -- when it does not warn -----------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_stall_warning_none_never_warns(worker_type: str) -> None:
    """``stall_warning=None`` turns the report off: a stall many times longer than the other
    tests' threshold gives no warning, and the epoch is delivered."""
    loader = make_loader(
        rd.Augmented(8, slow={3: STUCK}), worker_type=worker_type, stall_warning=None
    )
    batches, messages = epoch_with_warnings(loader)
    assert not messages
    assert indices_of(batches) == [[2 * i, 2 * i + 1] for i in range(4)]


@pytest.mark.timeout(60)
def test_default_threshold_is_five_minutes_and_a_quick_epoch_does_not_warn() -> None:
    """The default is 300 s; a normal, quick epoch (with the default) gives no warning."""
    assert inspect.signature(ferry.DataLoader).parameters["stall_warning"].default == 300.0
    loader = ferry.DataLoader(rd.Augmented(16), batch_size=2, num_workers=2)
    batches, messages = epoch_with_warnings(loader)
    assert not messages
    assert len(batches) == 8


@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_slowness_below_the_threshold_does_not_warn(worker_type: str) -> None:
    """Every sample takes 0.05 s (0.1 s a batch), far below ``stall_warning=1.5``: a slow but
    healthy epoch is never reported."""
    loader = make_loader(rd.Augmented(16, delay=0.05), worker_type=worker_type, stall_warning=1.5)
    batches, messages = epoch_with_warnings(loader)
    assert not messages
    assert indices_of(batches) == [[2 * i, 2 * i + 1] for i in range(8)]


@pytest.mark.timeout(60)
def test_no_report_without_workers() -> None:
    """With ``num_workers=0`` the training loop itself fetches: nothing waits on a worker, and
    no report is made however long a fetch takes."""
    loader = make_loader(rd.Augmented(4, slow={1: 1.0}), num_workers=0)
    batches, messages = epoch_with_warnings(loader)
    assert not messages
    assert indices_of(batches) == [[0, 1], [2, 3]]


# -- with timeout ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_timeout_still_raises_after_the_stall_warning() -> None:
    """``stall_warning`` below ``timeout``: the stall is reported first, then the timeout
    raises its WorkerTimeout as before, naming the worker and the indices."""
    loader = make_loader(rd.Augmented(8, slow={5: 4 * STUCK}), timeout=1.5)
    got: list[Any] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(WorkerTimeout, match=r"timed out after 1\.5 seconds") as raised:
            got.extend(loader)
    stalls = [str(w.message) for w in caught if issubclass(w.category, StallWarning)]
    assert len(stalls) == 1, stalls
    assert "fetching batch 2 (indices [4, 5])" in stalls[0]
    assert "indices [4, 5]" in str(raised.value)
    assert indices_of(got) == [[0, 1], [2, 3]]


# -- the option ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (0, ValueError),
        (0.0, ValueError),
        (-1, ValueError),
        (-0.5, ValueError),
        (math.nan, ValueError),
        ("5", TypeError),
        (True, TypeError),
        ([1], TypeError),
    ],
    ids=stable_id,
)
def test_invalid_stall_warning_is_refused(value: Any, error: type[Exception]) -> None:
    """Zero, negative, NaN, a string, a bool or a list: refused when the loader is made,
    with an error that names the option."""
    with pytest.raises(error, match="stall_warning"):
        ferry.DataLoader(rd.Augmented(4), num_workers=2, stall_warning=value)


@pytest.mark.parametrize("value", [None, 1, 0.25, 600.0, math.inf])
def test_valid_stall_warning_is_accepted(value: Any) -> None:
    """None, an int, a float and infinity (never) are accepted."""
    ferry.DataLoader(rd.Augmented(4), num_workers=2, stall_warning=value)
