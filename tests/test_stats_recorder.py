"""The recorder behind ``loader.stats()``: what each stage tells it and what it makes of that,
with a stand-in clock (the stages say what happened, the recorder measures it)."""

from __future__ import annotations

import pytest

from _support.clock import Clock
from ferry.stats import StatsRecorder


def test_timing_adds_the_blocks_seconds_to_its_stage_and_gives_its_start() -> None:
    clock = Clock()
    stats = StatsRecorder(2, clock)
    with stats.timing("sampler") as start:
        clock.now += 0.25
    assert start == 100.0
    with stats.timing("sampler"):
        clock.now += 0.5
    with stats.timing("hand_off"):
        clock.now += 2.0
    with stats.timing("pin"):
        clock.now += 4.0
    assert (stats.sampler, stats.hand_off, stats.pin) == (0.75, 2.0, 4.0)


def test_timing_counts_a_block_that_raises() -> None:
    clock = Clock()
    stats = StatsRecorder(1, clock)

    def drawn() -> None:
        with stats.timing("sampler"):
            clock.now += 0.5
            raise StopIteration

    with pytest.raises(StopIteration):
        drawn()
    assert stats.sampler == 0.5


def test_the_loops_wait_and_the_first_batch() -> None:
    clock = Clock()
    stats = StatsRecorder(1, clock)  # started at 100
    clock.now = 103.0
    asked = stats.asked()
    clock.now = 104.0
    stats.handed_out(asked)
    clock.now = 110.0
    asked = stats.asked()
    clock.now = 110.5
    stats.handed_out(asked)
    assert (stats.batches, stats.wait) == (2, 1.5)
    assert (stats.first_batch, stats.first_wait) == (4.0, 1.0)
    clock.now = 111.0
    asked = stats.asked()
    clock.now = 112.0
    stats.epoch_ended(asked)
    result = stats.result("thread")
    assert result.wall_s == 12.0
    assert result.wait_s == 2.5
    assert result.batches == 2


def test_counts_ready_waited_and_skipped() -> None:
    stats = StatsRecorder(2, Clock())
    stats.batch_ready()
    stats.batch_waited()
    stats.batch_waited()
    stats.samples_skipped(3)
    stats.samples_skipped(0)
    result = stats.result("process")
    assert (result.ready, result.waited, result.skipped) == (1, 2, 3)


def test_a_batch_made_inline_is_waited_for_and_its_cpu_time_counts_when_measured() -> None:
    stats = StatsRecorder(1, Clock())
    stats.made_here(0.5, 0.25, 0.5)
    stats.made_here(1.0, 0.0, -1.0)  # CPU time not measured for this one
    result = stats.result("inline")
    assert (result.fetch_s, result.collate_s) == (1.5, 0.25)
    assert (result.cpu_s, result.cpu_made_s) == (0.5, 0.75)
    assert (result.ready, result.waited) == (0, 2)
    assert result.workers == ()
