"""Bad-sample skipping: ``DataLoader(..., on_error="skip", max_errors=...)``.

* Map-style, batching on: a batch whose fetch raises is fetched again index by index; the
  indices that raise are dropped and the batch comes out short (a batch with no good sample is
  not yielded at all). Batching off: a failing sample is simply not yielded.
* Iterable-style: a failing item is dropped and the batch is filled from the next items of the
  same worker's stream; a generator that raised is finished, so its stream ends there.
* ``max_errors``: a count, or a fraction of the samples seen (judged once 100 were seen); past
  it the loader raises :class:`ferry.errors.TooManyErrors` listing the skipped samples.
* Each skip is logged once (logger ``"ferry"``, in the main process) and counted in
  ``loader.stats().skipped``; the error counts are part of the loader's state, and a resume
  does not fetch the samples dropped before the cut again.

Every behaviour is checked in the three engines where it applies: inline (``num_workers=0``),
two process workers (fork) and two thread workers. torch is the oracle wherever it has an
equivalent: its batch order with the bad samples removed, its stream with the bad items left
out (or the generator cut at the bad item), the exception it raises with ``on_error="raise"``.
"""

from __future__ import annotations

import collections
import inspect
import json
import logging
import math
import os
import re
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import ferry
from _support.processes import worker_pids
from ferry.errors import TooManyErrors
from workers import corner_datasets as cd
from workers import skip_datasets as sd

Loader = ferry.DataLoader[Any]

INLINE = pytest.param({}, id="inline")
PROCESS = pytest.param({"num_workers": 2, "multiprocessing_context": "fork"}, id="process")
THREAD = pytest.param({"num_workers": 2, "worker_type": "thread"}, id="thread")
ENGINES = [INLINE, PROCESS, THREAD]
IN_PROCESS = [INLINE, THREAD]  # engines whose dataset calls the test can read on the object
WITH_WORKERS = [PROCESS, THREAD]

SKIP_LOG = re.compile(
    r"ferry\.DataLoader skipped (?:index (?P<index>\d+)|stream item (?P<item>\d+)) "
    r"\(worker (?P<worker>\d+), pid (?P<pid>\d+)\): (?P<type>\w+): (?P<message>.*?)"
    r"(?: at (?P<where>\S+:\d+ in \S+))?$"
)


# -- helpers ---------------------------------------------------------------------------------


def plain(batch: Any) -> Any:
    """A batch as plain Python (a tensor's list, a 0-d tensor's number)."""
    return batch.tolist() if isinstance(batch, torch.Tensor) else batch


def epoch(loader: Iterable[Any]) -> list[Any]:
    return [plain(batch) for batch in loader]


def take(iterator: Iterator[Any], count: int) -> list[Any]:
    return [plain(next(iterator)) for _ in range(count)]


def until_error(iterator: Iterator[Any], limit: int = 100) -> tuple[list[Any], BaseException]:
    """``next()`` until an exception: the batches before it, and the exception (StopIteration
    at the end of the epoch)."""
    got: list[Any] = []
    for _ in range(limit):
        try:
            got.append(plain(next(iterator)))
        except Exception as exc:  # the point is to record it
            return got, exc
    raise AssertionError(f"no exception within {limit} batches")


def skipping(dataset: Any, engine: dict[str, Any], **options: Any) -> Loader:
    return ferry.DataLoader(dataset, on_error="skip", **engine, **options)


def sequential_batches(n: int, batch_size: int) -> list[list[int]]:
    return [list(range(start, min(start + batch_size, n))) for start in range(0, n, batch_size)]


def without(batches: Iterable[list[int]], bad: Iterable[int]) -> list[list[int]]:
    """The batches with the ``bad`` samples removed, and those left empty dropped: what a
    skipping loader yields for these keys."""
    bad = set(bad)
    kept = ([i for i in batch if i not in bad] for batch in batches)
    return [batch for batch in kept if batch]


def round_trip(state: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(json.dumps(state))
    return loaded


def skip_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "ferry" and r.getMessage().startswith("ferry.DataLoader skipped")
    ]


def parsed(record: logging.LogRecord) -> dict[str, str]:
    match = SKIP_LOG.match(record.getMessage())
    assert match is not None, f"unexpected skip log line: {record.getMessage()!r}"
    return match.groupdict()


def expected_worker(engine: dict[str, Any], batch_number: int) -> int:
    """Which worker makes map-style batch ``batch_number`` (workers take keys in turn)."""
    return batch_number % int(engine.get("num_workers", 1))


# -- map-style: short batches ------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_bad_samples_leave_short_batches_of_the_good_ones_in_order(engine: dict[str, Any]) -> None:
    """Each failing index is dropped from its batch; the batch keeps its other samples, in
    order, and is not refilled from later keys (the later batches keep their boundaries)."""
    bad = {1, 5, 13, 19}
    loader = skipping(sd.Flaky(20, bad), engine, batch_size=3)
    assert epoch(loader) == [[0, 2], [3, 4], [6, 7, 8], [9, 10, 11], [12, 14], [15, 16, 17], [18]]
    assert loader.stats().skipped == 4
    assert loader.state_dict()["errors"] == {"skipped": 4, "seen": 20}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_batch_whose_samples_all_fail_is_not_yielded(engine: dict[str, Any]) -> None:
    """A batch with no good sample yields nothing (no empty batch); the loader goes on with the
    next key, also when several such batches follow each other or end the epoch."""
    bad = {3, 4, 5, 6, 7, 8, 15, 16}
    loader = skipping(sd.Flaky(17, bad), engine, batch_size=3)
    expected = without(sequential_batches(17, 3), bad)
    assert expected == [[0, 1, 2], [9, 10, 11], [12, 13, 14]]
    assert epoch(loader) == expected
    assert loader.stats().skipped == len(bad)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_epoch_of_only_bad_samples_yields_nothing(engine: dict[str, Any]) -> None:
    """With no limit, an epoch where every sample fails ends normally without a batch."""
    loader = skipping(sd.Flaky(10, range(10)), engine, batch_size=4)
    assert epoch(loader) == []
    assert loader.stats().skipped == 10
    assert loader.state_dict()["errors"] == {"skipped": 10, "seen": 10}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_batching_off_does_not_yield_failing_samples(engine: dict[str, Any]) -> None:
    """``batch_size=None``: each sample is its own key; a failing one is simply not yielded."""
    loader = skipping(sd.Flaky(10, {0, 3, 4, 9}), engine, batch_size=None)
    assert epoch(loader) == [1, 2, 5, 6, 7, 8]
    assert loader.stats().skipped == 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_drop_last_drops_only_the_samplers_short_batch(engine: dict[str, Any]) -> None:
    """``drop_last`` applies to the sampler's batches: a batch made short by skips is still
    yielded, and the sampler's incomplete last batch is still dropped (never fetched)."""
    dataset = sd.Flaky(11, {4, 10})
    loader = skipping(dataset, engine, batch_size=3, drop_last=True)
    assert epoch(loader) == [[0, 1, 2], [3, 5], [6, 7, 8]]
    assert loader.stats().skipped == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_shuffled_epoch_is_torchs_order_without_the_bad_samples(engine: dict[str, Any]) -> None:
    """With ``shuffle=True`` and a seeded generator, the batches are torch's batches (same
    seed) with the bad samples removed and the emptied batch left out."""
    n, batch_size = 30, 4
    torch_batches = epoch(
        tud.DataLoader(
            sd.Flaky(n),
            batch_size=batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(7),
        )
    )
    # A whole batch of torch's order, and scattered samples of two others.
    bad = set(torch_batches[1]) | {torch_batches[3][0], torch_batches[5][2]}
    loader = skipping(
        sd.Flaky(n, bad),
        engine,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(7),
    )
    expected = without(torch_batches, bad)
    assert len(expected) == len(torch_batches) - 1
    assert epoch(loader) == expected
    assert loader.stats().skipped == len(bad)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", WITH_WORKERS)
def test_out_of_order_delivery_yields_every_good_sample_once(engine: dict[str, Any]) -> None:
    """``in_order=False``: the same short batches (in any order), each exactly once."""
    bad = {1, 6, 7, 8, 13}
    loader = skipping(sd.Flaky(20, bad), engine, batch_size=3, in_order=False)
    got = collections.Counter(tuple(batch) for batch in epoch(loader))
    expected = collections.Counter(tuple(b) for b in without(sequential_batches(20, 3), bad))
    assert got == expected
    assert loader.stats().skipped == len(bad)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_tensor_dataset_batches_drop_indices_that_fail(engine: dict[str, Any]) -> None:
    """A :class:`ferry.TensorDataset` gathers a batch in one indexing call; an index that fails
    (out of range here) is dropped after the per-index retry, as for any dataset."""
    dataset = ferry.TensorDataset(torch.arange(10) * 10)
    loader = skipping(dataset, engine, batch_sampler=[[0, 1, 99, 2], [3, 4], [50]])
    got = [[t.tolist() for t in batch] for batch in loader]
    assert got == [[[0, 10, 20]], [[30, 40]]]
    assert loader.stats().skipped == 2


# -- map-style: which calls are made -----------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", IN_PROCESS)
def test_failing_batch_is_fetched_again_index_by_index(engine: dict[str, Any]) -> None:
    """A batch whose fetch succeeds is fetched once; one that raises is fetched again index by
    index (the first try stopped at the failing index). Thread workers read sample by sample
    (ferry._engine.work.reads), so there every index is read once."""
    dataset = sd.Flaky(9, {4})
    loader = skipping(dataset, engine, batch_size=3)
    assert epoch(loader) == [[0, 1, 2], [3, 5], [6, 7, 8]]
    if engine:  # thread workers interleave their batches' calls
        assert collections.Counter(dataset.calls) == collections.Counter(range(9))
    else:
        assert dataset.calls == [0, 1, 2, 3, 4, 3, 4, 5, 6, 7, 8]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", IN_PROCESS)
def test_getitems_batch_failure_retries_each_index_alone(engine: dict[str, Any]) -> None:
    """A dataset with ``__getitems__`` gets each batch in one call; when that call raises, each
    index of the batch is asked for alone (``__getitems__([i])``) and only the failing ones are
    dropped; ``__getitem__`` is never used."""
    dataset = sd.FlakyItems(9, {4})
    loader = skipping(dataset, engine, batch_size=3)
    assert epoch(loader) == [[0, 1, 2], [3, 5], [6, 7, 8]]
    expected = [[0, 1, 2], [3, 4, 5], [3], [4], [5], [6, 7, 8]]
    if engine:
        got = collections.Counter(tuple(call) for call in dataset.calls)
        assert got == collections.Counter(tuple(call) for call in expected)
    else:
        assert dataset.calls == expected


@pytest.mark.timeout(60)
def test_process_workers_retry_only_the_failing_batches(tmp_path: Path) -> None:
    """In process workers too, only the batches whose call raised are fetched again, index by
    index (the calls are recorded through a file)."""
    log = str(tmp_path / "calls")
    dataset = sd.FlakyItems(12, {4, 9, 10, 11}, log=log)
    loader = skipping(dataset, {"num_workers": 2, "multiprocessing_context": "fork"}, batch_size=3)
    assert epoch(loader) == [[0, 1, 2], [3, 5], [6, 7, 8]]
    expected = [[0, 1, 2], [3, 4, 5], [3], [4], [5], [6, 7, 8], [9, 10, 11], [9], [10], [11]]
    got = collections.Counter(tuple(call) for call in sd.logged_calls(log))
    assert got == collections.Counter(tuple(call) for call in expected)


# -- iterable-style ----------------------------------------------------------------------------


def torch_workers(engine: dict[str, Any]) -> int:
    """The number of torch process workers that shard a stream as ``engine`` does."""
    return int(engine.get("num_workers", 0))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_iterator_stream_goes_on_after_a_failing_item(engine: dict[str, Any]) -> None:
    """A stream whose iterator object raises for an item: the item is dropped, the iterator is
    asked again, and the batch is filled from the next items of the same worker's stream. The
    batches are torch's over the same stream with the bad items left out."""
    bad = {2, 3, 9}
    oracle = tud.DataLoader(
        sd.IteratorStream(20, bad, omit=True), batch_size=3, num_workers=torch_workers(engine)
    )
    expected = epoch(oracle)
    loader = skipping(sd.IteratorStream(20, bad), engine, batch_size=3)
    assert epoch(loader) == expected
    assert sorted(v for batch in expected for v in batch) == sorted(set(range(20)) - bad)
    assert loader.stats().skipped == 3
    assert loader.state_dict()["errors"] == {"skipped": 3, "seen": 20}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_generator_stream_ends_at_its_failing_item(engine: dict[str, Any]) -> None:
    """A generator that raised is finished: its stream ends at the failing item (the batch in
    progress comes out short) while other workers' streams go on. The batches are torch's over
    the same streams cut at the bad items."""
    bad = {3, 14}
    oracle = tud.DataLoader(
        sd.GeneratorStream(20, bad, truncate=True), batch_size=3, num_workers=torch_workers(engine)
    )
    expected = epoch(oracle)
    loader = skipping(sd.GeneratorStream(20, bad), engine, batch_size=3)
    got = epoch(loader)
    assert got == expected
    if engine:  # worker 1 (odd values) ends at 3; worker 0 (even values) at 14
        assert got == [[0, 2, 4], [1], [6, 8, 10], [12]]
    else:
        assert got == [[0, 1, 2]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_stream_with_batching_off_does_not_yield_failing_items(engine: dict[str, Any]) -> None:
    """``batch_size=None`` on a stream: a failing item is not yielded and its worker reads on
    to its next item in the same turn, so the order is torch's over the streams without the
    bad items."""
    bad = {2, 3, 7}
    loader = skipping(sd.IteratorStream(10, bad), engine, batch_size=None)
    got = epoch(loader)
    if engine:  # worker 0 reads 0, 4, 6, 8 (2 dropped), worker 1 reads 1, 5, 9 (3, 7 dropped)
        assert got == [0, 1, 4, 5, 6, 9, 8]
    else:
        assert got == [0, 1, 4, 5, 6, 8, 9]
    assert loader.stats().skipped == 3


def test_stream_items_failing_in_a_row_hand_out_the_batch_so_far() -> None:
    """Failing items are replaced by the next ones in the batch; after 32 failures in a row
    (at least the batch size) the batch is handed out as it stands, so the main process can
    judge the budget; the next batch goes on with the stream."""
    loader = skipping(sd.IteratorStream(12, {1, 2, 3}), {}, batch_size=3)
    assert epoch(loader) == [[0, 4, 5], [6, 7, 8], [9, 10, 11]]
    loader = skipping(sd.IteratorStream(50, set(range(1, 40))), {}, batch_size=3)
    assert epoch(loader) == [[0], [40, 41, 42], [43, 44, 45], [46, 47, 48], [49]]
    assert loader.stats().skipped == 39


def test_stream_of_only_failing_items_raises_past_the_budget() -> None:
    """An endless run of failing items does not loop forever inside one ``next()``: the
    budget is judged as they fail."""
    loader = skipping(sd.FailingForever(), {}, batch_size=4, max_errors=10)
    with pytest.raises(TooManyErrors, match=r"skipped 32 samples out of 32 seen"):
        next(iter(loader))


def test_stream_that_cannot_be_opened_still_raises() -> None:
    """An exception from ``__iter__`` (opening the stream) is not a bad sample: it raises."""
    loader = skipping(sd.UnopenableStream(), {}, batch_size=2)
    with pytest.raises(OSError, match="cannot be opened"):
        epoch(loader)


# -- the budget --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_count_budget_allows_exactly_max_errors(engine: dict[str, Any]) -> None:
    """``max_errors=3`` with exactly three bad samples: the epoch completes."""
    loader = skipping(sd.Flaky(12, {1, 5, 9}), engine, batch_size=3, max_errors=3)
    assert epoch(loader) == [[0, 2], [3, 4], [6, 7, 8], [10, 11]]
    assert loader.stats().skipped == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_count_budget_raises_at_the_batch_with_one_skip_too_many(engine: dict[str, Any]) -> None:
    """``max_errors=2`` with three bad samples: the batches before the third skip are yielded,
    then :class:`TooManyErrors` (a RuntimeError) is raised in place of the batch holding it."""
    loader = skipping(sd.Flaky(12, {1, 5, 9}), engine, batch_size=3, max_errors=2)
    got, exc = until_error(iter(loader))
    assert got == [[0, 2], [3, 4], [6, 7, 8]]
    assert isinstance(exc, TooManyErrors)
    assert isinstance(exc, RuntimeError)
    assert "skipped 3 samples out of 12 seen" in str(exc)
    assert "max_errors=2" in str(exc)


def test_max_errors_zero_raises_at_the_first_skip() -> None:
    """``max_errors=0`` turns the first bad sample into :class:`TooManyErrors`."""
    loader = skipping(sd.Flaky(9, {4}), {}, batch_size=3, max_errors=0)
    got, exc = until_error(iter(loader))
    assert got == [[0, 1, 2]]
    assert isinstance(exc, TooManyErrors)


@pytest.mark.parametrize(
    ("n", "bad"),
    [
        pytest.param(200, range(10), id="early-failures-below-the-fraction-later"),
        pytest.param(90, range(90), id="every-sample-of-a-small-dataset"),
    ],
)
def test_fraction_budget_is_not_judged_before_100_samples(n: int, bad: range) -> None:
    """A fraction is judged only once 100 samples were seen: failures among the first samples,
    however many of them, raise nothing by themselves."""
    loader = skipping(sd.Flaky(n, bad), {}, batch_size=10, max_errors=0.5)
    got = epoch(loader)
    assert sum(len(batch) for batch in got) == n - len(bad)
    assert loader.state_dict()["errors"] == {"skipped": len(bad), "seen": n}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_fraction_budget_raises_once_judged(engine: dict[str, Any]) -> None:
    """60% of the samples fail with ``max_errors=0.5``: nothing is raised for the first 90
    samples; the first failure once 100 were seen raises, listing the fraction."""
    bad = [i for i in range(300) if i % 5 < 3]
    loader = skipping(sd.Flaky(300, bad), engine, batch_size=10, max_errors=0.5)
    got, exc = until_error(iter(loader))
    assert len(got) == 9
    assert all(len(batch) == 4 for batch in got)
    assert isinstance(exc, TooManyErrors)
    assert "skipped 60 samples out of 100 seen" in str(exc)
    assert "max_errors=0.5 (50.0% of the samples seen, judged after 100)" in str(exc)
    assert loader.state_dict()["errors"] == {"skipped": 60, "seen": 100}


def test_fraction_is_of_the_samples_seen_not_of_the_dataset() -> None:
    """The fraction compares the skips with the samples seen so far: after 120 good samples
    and then only bad ones, ``max_errors=0.5`` raises at the first batch where the skips are
    more than half of the samples seen (130 of 250), long before half the dataset failed."""
    loader = skipping(sd.Flaky(1000, range(120, 1000)), {}, batch_size=10, max_errors=0.5)
    got, exc = until_error(iter(loader))
    assert len(got) == 12
    assert isinstance(exc, TooManyErrors)
    assert loader.state_dict()["errors"] == {"skipped": 130, "seen": 250}


def test_fraction_budget_is_judged_once_enough_samples_were_seen() -> None:
    """60 of the 100 samples of an epoch fail with ``max_errors=0.5``: once the 100 samples
    are seen the fraction (60%) is past the limit, so the loader must raise before the epoch
    ends, not finish as if the data were fine."""
    loader = skipping(sd.Flaky(100, range(60)), {}, batch_size=10, max_errors=0.5)
    with pytest.raises(TooManyErrors):
        epoch(loader)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_summary_names_index_worker_pid_and_exception_of_each_skip(engine: dict[str, Any]) -> None:
    """The :class:`TooManyErrors` message lists every skipped sample: its index, the worker
    that fetched it and that worker's pid, the exception's type and message, and where in the
    user's code it was raised."""
    loader = skipping(sd.Flaky(9, {1, 4}), engine, batch_size=3, max_errors=1)
    iterator = iter(loader)
    got, exc = until_error(iterator)
    assert got == [[0, 2]]
    assert isinstance(exc, TooManyErrors)
    lines = str(exc).splitlines()
    assert lines[0].startswith("DataLoader skipped 2 samples out of 6 seen")
    entries = [SKIP_LOG.match("ferry.DataLoader skipped " + line.strip()) for line in lines[1:]]
    assert all(entries), lines
    if engine.get("multiprocessing_context"):
        pids = worker_pids(iterator)
        assert os.getpid() not in pids
    else:  # the main process, or thread workers in it
        pids = [os.getpid()] * max(engine.get("num_workers", 1), 1)
    for entry, index, batch_number in zip(entries, (1, 4), (0, 1), strict=True):
        assert entry is not None
        worker = expected_worker(engine, batch_number)
        assert entry["index"] == str(index)
        assert entry["worker"] == str(worker)
        assert entry["pid"] == str(pids[worker])
        assert entry["type"] == "Corrupt"
        assert entry["message"] == f"corrupt sample {index}"
        assert entry["where"] is not None
        assert entry["where"].startswith(sd.__file__)


def test_summary_lists_100_skips_and_counts_the_rest() -> None:
    """Past 100 skipped samples the summary lists the first 100 and counts the others."""
    loader = skipping(sd.Flaky(150, range(150)), {}, batch_size=10, max_errors=149)
    with pytest.raises(TooManyErrors) as info:
        epoch(loader)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("DataLoader skipped 150 samples out of 150 seen")
    listed = [line for line in lines if line.strip().startswith("index ")]
    assert [int(line.split()[1]) for line in listed] == list(range(100))
    assert lines[-1].strip() == "... and 50 more (logged)"


# -- logging and statistics --------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_each_skip_is_logged_once_by_the_main_process(
    engine: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Every skipped sample is logged once, at WARNING on the ``"ferry"`` logger, by the main
    process (also for process workers), naming the index, the worker, the pid and the
    exception."""
    bad = [1, 4, 5, 13]
    loader = skipping(sd.Flaky(15, bad), engine, batch_size=3)
    with caplog.at_level(logging.WARNING, logger="ferry"):
        epoch(loader)
    records = skip_records(caplog)
    assert len(records) == len(bad)
    assert all(r.levelno == logging.WARNING for r in records)
    assert all(r.process == os.getpid() for r in records)
    fields = [parsed(r) for r in records]
    assert sorted(int(f["index"]) for f in fields) == bad
    for f in fields:
        index = int(f["index"])
        assert f["worker"] == str(expected_worker(engine, index // 3))
        assert f["type"] == "Corrupt"
        assert f["message"] == f"corrupt sample {index}"
        if engine.get("multiprocessing_context"):
            assert int(f["pid"]) != os.getpid()
        else:
            assert int(f["pid"]) == os.getpid()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_stream_skips_are_logged_with_the_item_number_in_the_workers_stream(
    engine: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A stream's skip names the item's number in its worker's stream (``stream item N``),
    the worker, and the exception."""
    loader = skipping(sd.IteratorStream(12, {2, 3}), engine, batch_size=3)
    with caplog.at_level(logging.WARNING, logger="ferry"):
        epoch(loader)
    fields = [parsed(r) for r in skip_records(caplog)]
    got = sorted((f["item"], f["worker"], f["message"]) for f in fields)
    if engine:  # worker 0 streams 0, 2, 4, ...; worker 1 streams 1, 3, 5, ...
        expected = [("1", "0", "corrupt stream value 2"), ("1", "1", "corrupt stream value 3")]
    else:
        expected = [("2", "0", "corrupt stream value 2"), ("3", "0", "corrupt stream value 3")]
    assert got == expected


def test_good_data_logs_and_counts_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """Skipping enabled on data without a bad sample: no log, no count, no line in the stats."""
    loader = skipping(sd.Flaky(10), {}, batch_size=3, max_errors=0)
    with caplog.at_level(logging.WARNING, logger="ferry"):
        assert epoch(loader) == sequential_batches(10, 3)
    assert not skip_records(caplog)
    assert loader.stats().skipped == 0
    assert "on_error" not in str(loader.stats())
    assert loader.state_dict()["errors"] == {"skipped": 0, "seen": 10}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_stats_count_the_skips_of_the_epoch(engine: dict[str, Any]) -> None:
    """``loader.stats().skipped`` counts the samples dropped in the epoch so far (only those
    of batches handed out), and the printed statistics say how many were dropped."""
    loader = skipping(sd.Flaky(12, {1, 2, 7}), engine, batch_size=3)
    iterator = iter(loader)
    assert take(iterator, 1) == [[0]]
    assert loader.stats().skipped == 2
    assert take(iterator, 2) == [[3, 4, 5], [6, 8]]
    assert loader.stats().skipped == 3
    assert "on_error='skip' dropped 3 samples" in str(loader.stats())
    del iterator
    epoch(loader)  # another epoch: counted afresh
    assert loader.stats().skipped == 3


# -- resume --------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_resume_after_skips_goes_on_like_the_uninterrupted_run(
    engine: dict[str, Any], tmp_path: Path
) -> None:
    """A state taken after some skips (one of them a whole batch) resumes into the batches the
    uninterrupted run yields; the samples before the cut, the bad ones included, are not
    fetched again; the state carries the error counts on."""
    bad = {1, 3, 4, 5, 13}

    def make(log: str | None = None) -> Loader:
        return skipping(sd.Flaky(20, bad, log=log), engine, batch_size=3)

    reference = epoch(make())
    assert reference == [[0, 2], [6, 7, 8], [9, 10, 11], [12, 14], [15, 16, 17], [18, 19]]

    loader = make()
    iterator = iter(loader)
    assert take(iterator, 2) == reference[:2]
    state = round_trip(loader.state_dict())
    del iterator
    assert state["errors"] == {"skipped": 4, "seen": 9}

    log = str(tmp_path / "resumed")
    fresh = make(log)
    fresh.load_state_dict(state)
    assert epoch(fresh) == reference[2:]
    fetched = set(sd.logged_calls(log))
    assert fetched, "the resumed loader fetched nothing"
    assert min(fetched) >= 9, f"samples before the cut were fetched again: {sorted(fetched)}"
    assert fresh.state_dict()["errors"] == {"skipped": 5, "seen": 20}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_batch_that_broke_the_budget_is_not_fetched_again_after_a_resume(
    engine: dict[str, Any], tmp_path: Path
) -> None:
    """The batch whose skips raised :class:`TooManyErrors` counts as consumed: a state taken
    after the raise resumes after it, and the budget, already spent, raises at the next skip."""
    bad = {1, 4, 7}

    def make(log: str | None = None) -> Loader:
        return skipping(sd.Flaky(12, bad, log=log), engine, batch_size=3, max_errors=1)

    loader = make()
    got, exc = until_error(iter(loader))
    assert got == [[0, 2]]
    assert isinstance(exc, TooManyErrors)
    del exc
    state = round_trip(loader.state_dict())
    assert state["errors"] == {"skipped": 2, "seen": 6}

    log = str(tmp_path / "resumed")
    fresh = make(log)
    fresh.load_state_dict(state)
    got, exc = until_error(iter(fresh))
    assert got == []
    assert isinstance(exc, TooManyErrors)
    assert "skipped 3 samples out of 9 seen" in str(exc)
    assert not set(sd.logged_calls(log)) & set(range(6))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_budget_continues_across_a_resume(engine: dict[str, Any]) -> None:
    """``max_errors=3``, two skips before the state and two after: the resumed loader raises at
    the fourth skip, as the uninterrupted run does (the count came with the state)."""
    bad = {1, 4, 10, 13}

    def make() -> Loader:
        return skipping(sd.Flaky(18, bad), engine, batch_size=3, max_errors=3)

    reference, exc = until_error(iter(make()))
    assert reference == [[0, 2], [3, 5], [6, 7, 8], [9, 11]]
    assert isinstance(exc, TooManyErrors)

    loader = make()
    iterator = iter(loader)
    assert take(iterator, 3) == reference[:3]
    state = round_trip(loader.state_dict())
    del iterator
    assert state["errors"] == {"skipped": 2, "seen": 9}

    fresh = make()
    fresh.load_state_dict(state)
    got, exc = until_error(iter(fresh))
    assert got == reference[3:]
    assert isinstance(exc, TooManyErrors)
    assert "skipped 4 samples out of 15 seen" in str(exc)


@pytest.mark.parametrize("change", ["zeroed", "absent"])
def test_resumed_budget_is_the_states_count(change: str) -> None:
    """The resumed budget starts from the state's counts: with them zeroed, or absent (a state
    saved before the option existed), the same resume spends a fresh budget and completes."""
    bad = {1, 4, 10, 13}

    def make() -> Loader:
        return skipping(sd.Flaky(18, bad), {}, batch_size=3, max_errors=3)

    loader = make()
    iterator = iter(loader)
    take(iterator, 3)
    state = round_trip(loader.state_dict())
    if change == "zeroed":
        state["errors"] = {"skipped": 0, "seen": 0}
    else:
        del state["errors"]

    fresh = make()
    fresh.load_state_dict(state)
    assert epoch(fresh) == [[9, 11], [12, 14], [15, 16, 17]]
    assert fresh.state_dict()["errors"] == {"skipped": 2, "seen": 9}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", ["iterator", "generator"])
@pytest.mark.parametrize("engine", ENGINES)
def test_stream_without_state_resumes_past_a_failing_item(
    engine: dict[str, Any], stream: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream with no state resumes by reading and dropping what was delivered: a failing
    item before the cut is dropped again silently (not logged or counted a second time), and
    the batches after the cut are the uninterrupted run's."""

    def make() -> Loader:
        if stream == "iterator":
            dataset: Any = sd.IteratorStream(20, {2, 3, 9})
        else:
            dataset = sd.GeneratorStream(20, {3} if engine else {13})
        return skipping(dataset, engine, batch_size=3)

    reference_loader = make()
    reference = epoch(reference_loader)
    total = reference_loader.state_dict()["errors"]
    cut = 2

    loader = make()
    iterator = iter(loader)
    assert take(iterator, cut) == reference[:cut]
    state = round_trip(loader.state_dict())
    del iterator
    before = state["errors"]["skipped"]
    if stream == "iterator" or engine:
        assert before >= 1, "the cut should come after a failing item"

    fresh = make()
    with pytest.warns(UserWarning, match="fast-forwards"):
        fresh.load_state_dict(state)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ferry"):
        assert epoch(fresh) == reference[cut:]
    assert fresh.state_dict()["errors"] == total
    assert len(skip_records(caplog)) == total["skipped"] - before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", WITH_WORKERS)
def test_out_of_order_resume_after_skips_yields_every_good_batch_once(
    engine: dict[str, Any],
) -> None:
    """``in_order=False``: a state taken after skips (a whole batch among them) resumes into
    the rest of the good batches, each exactly once, and the error counts add up to the
    uninterrupted run's."""
    bad = {1, 6, 7, 8, 13, 22}

    def make() -> Loader:
        return skipping(sd.Flaky(30, bad), engine, batch_size=3, in_order=False)

    reference_loader = make()
    reference = collections.Counter(tuple(b) for b in epoch(reference_loader))
    loader = make()
    iterator = iter(loader)
    first = take(iterator, 3)
    state = round_trip(loader.state_dict())
    del iterator
    fresh = make()
    fresh.load_state_dict(state)
    got = collections.Counter(tuple(b) for b in first + epoch(fresh))
    assert got == reference
    assert fresh.state_dict()["errors"] == reference_loader.state_dict()["errors"]
    assert fresh.state_dict()["errors"] == {"skipped": 6, "seen": 30}


def test_resume_between_epochs_keeps_the_budget_of_the_uninterrupted_run() -> None:
    """The budget spans the run, not one epoch: two bad samples per epoch with
    ``max_errors=3`` pass the first epoch and break the budget in the second, at the same
    batch whether the loader ran on or was resumed from the state saved between epochs."""

    def make() -> Loader:
        return skipping(sd.Flaky(10, {1, 4}), {}, batch_size=3, max_errors=3)

    loader = make()
    first = epoch(loader)
    state = round_trip(loader.state_dict())
    assert state["errors"] == {"skipped": 2, "seen": 10}
    uninterrupted, exc = until_error(iter(loader))
    assert isinstance(exc, TooManyErrors)

    fresh = make()
    fresh.load_state_dict(state)
    resumed, exc = until_error(iter(fresh))
    assert isinstance(exc, TooManyErrors)
    assert resumed == uninterrupted == first[:1]
    assert fresh.state_dict()["errors"] == loader.state_dict()["errors"]


@pytest.mark.timeout(60)
def test_persistent_workers_do_not_change_the_budget() -> None:
    """Two bad samples per epoch with ``max_errors=3``: whether the workers persist between
    epochs must not change what the second epoch yields."""
    outcomes = []
    for persistent in (False, True):
        loader = skipping(
            sd.Flaky(10, {1, 4}),
            {"num_workers": 2, "worker_type": "thread"},
            batch_size=3,
            max_errors=3,
            persistent_workers=persistent,
        )
        epochs: list[Any] = []
        for _ in range(2):
            try:
                epochs.append(epoch(loader))
            except TooManyErrors:
                epochs.append("TooManyErrors")
        outcomes.append(epochs)
        loader._iterator = None  # persistent workers stop now
    assert outcomes[1] == outcomes[0]
    assert outcomes[0][1] == "TooManyErrors"  # the budget spans the run


# -- options -------------------------------------------------------------------------------------


@pytest.mark.parametrize("on_error", ["ignore", "SKIP", None, True, ""])
def test_on_error_must_be_raise_or_skip(on_error: Any) -> None:
    with pytest.raises(ValueError, match=r"on_error must be 'raise' .* or 'skip'"):
        ferry.DataLoader(sd.Flaky(4), on_error=on_error)


@pytest.mark.parametrize("on_error", [{}, {"on_error": "raise"}])
@pytest.mark.parametrize("max_errors", [0, 3, 0.5])
def test_max_errors_needs_on_error_skip(on_error: dict[str, Any], max_errors: Any) -> None:
    with pytest.raises(ValueError, match="max_errors bounds the samples on_error='skip' may"):
        ferry.DataLoader(sd.Flaky(4), max_errors=max_errors, **on_error)


@pytest.mark.parametrize("max_errors", ["3", True, False, [1], 2j])
def test_max_errors_must_be_a_count_or_a_fraction(max_errors: Any) -> None:
    with pytest.raises(TypeError, match="max_errors must be a count"):
        ferry.DataLoader(sd.Flaky(4), on_error="skip", max_errors=max_errors)


@pytest.mark.parametrize("max_errors", [-1, 0.0, 1.0, 1.5, -0.5, math.nan, math.inf])
def test_max_errors_out_of_range_is_refused(max_errors: Any) -> None:
    with pytest.raises(ValueError, match="max_errors as a"):
        ferry.DataLoader(sd.Flaky(4), on_error="skip", max_errors=max_errors)


@pytest.mark.parametrize("max_errors", [None, 0, 1, 10**6, 0.001, 0.999])
def test_valid_max_errors_are_accepted(max_errors: Any) -> None:
    loader: Loader = ferry.DataLoader(sd.Flaky(4), on_error="skip", max_errors=max_errors)
    assert epoch(loader) == [[0], [1], [2], [3]]


def test_failure_options_are_keyword_only_with_torchs_defaults() -> None:
    parameters = inspect.signature(ferry.DataLoader).parameters
    for name, default in (("on_error", "raise"), ("max_errors", None)):
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert parameters[name].default == default


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options", [{}, {"on_error": "raise"}], ids=["default", "explicit"])
@pytest.mark.parametrize("engine", ENGINES)
def test_on_error_raise_propagates_the_samples_exception_like_torch(
    engine: dict[str, Any], options: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Without skipping, a failing sample raises its own exception where torch raises it
    (after the same batches), and nothing is logged or counted."""
    torch_got, torch_exc = until_error(iter(tud.DataLoader(sd.Flaky(9, {4}), batch_size=3)))
    loader: Loader = ferry.DataLoader(sd.Flaky(9, {4}), batch_size=3, **engine, **options)
    with caplog.at_level(logging.WARNING, logger="ferry"):
        got, exc = until_error(iter(loader))
    assert got == torch_got == [[0, 1, 2]]
    assert type(exc) is type(torch_exc) is sd.Corrupt
    assert str(exc) == str(torch_exc) == "corrupt sample 4"
    assert not skip_records(caplog)
    assert loader.stats().skipped == 0


# -- what skipping does not swallow --------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch_size", [3, None])
@pytest.mark.parametrize("engine", ENGINES)
def test_stop_iteration_still_ends_a_map_style_epoch(
    engine: dict[str, Any], batch_size: int | None
) -> None:
    """A map-style ``__getitem__`` raising StopIteration ends the epoch, as in torch, also
    when skipping: the batches are torch's (on the same dataset without bad samples) with the
    bad samples removed, and the StopIteration is not counted as a skip."""
    torch_batches = epoch(tud.DataLoader(sd.Flaky(20, stop=10), batch_size=batch_size))
    loader = skipping(sd.Flaky(20, {1}, stop=10), engine, batch_size=batch_size)
    if batch_size is None:
        assert epoch(loader) == [i for i in torch_batches if i != 1]
    else:
        assert epoch(loader) == without(torch_batches, {1})
    assert loader.stats().skipped == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "bad", [pytest.param({1}, id="batch-fetched-whole"), pytest.param({6}, id="batch-retried")]
)
@pytest.mark.parametrize("engine", ENGINES)
def test_collate_fn_error_on_good_samples_still_raises(
    engine: dict[str, Any], bad: set[int]
) -> None:
    """An exception from ``collate_fn`` is not a bad sample: it raises, whether the batch was
    fetched in one go or index by index after a failure."""
    loader = skipping(sd.Flaky(12, bad), engine, batch_size=3, collate_fn=sd.RefusingCollate(7))
    got, exc = until_error(iter(loader))
    assert got == without(sequential_batches(12, 3)[:2], bad)
    assert type(exc) is ValueError
    assert str(exc) == "collate_fn refuses sample 7"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", WITH_WORKERS)
def test_worker_init_fn_error_still_raises(engine: dict[str, Any]) -> None:
    """An exception from ``worker_init_fn`` is not a bad sample: it reaches the user."""
    loader = skipping(sd.Flaky(9, {4}), engine, batch_size=3, worker_init_fn=cd.FailingInit(1))
    with pytest.raises(cd.InitFailed, match="worker_init_fn refused worker 1"):
        epoch(loader)


@pytest.mark.timeout(60)
def test_process_worker_skips_an_exception_that_cannot_be_pickled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A skipped sample is reported by name, type and message: an exception that could not
    travel from a process worker is skipped and logged like any other."""
    dataset = sd.Flaky(9, {4}, unpicklable=True)
    loader = skipping(dataset, {"num_workers": 2, "multiprocessing_context": "fork"}, batch_size=3)
    with caplog.at_level(logging.WARNING, logger="ferry"):
        assert epoch(loader) == [[0, 1, 2], [3, 5], [6, 7, 8]]
    [record] = skip_records(caplog)
    fields = parsed(record)
    assert (fields["index"], fields["type"], fields["message"]) == (
        "4",
        "Unpicklable",
        "corrupt sample 4",
    )


def test_skips_issue_no_python_warning() -> None:
    """Skipping reports through logging only: an epoch with skips issues no Python warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        epoch(skipping(sd.Flaky(6, {2}), {}, batch_size=2))
    assert not caught
