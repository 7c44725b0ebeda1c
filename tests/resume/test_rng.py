"""The worker-side capture of a process's global generators (``ferry._core.rng``)."""

from __future__ import annotations

import random

import numpy as np
import torch

from ferry._core.rng import ProcessRng, RngWatch


def test_a_batch_that_draws_nothing_reports_nothing() -> None:
    watch = RngWatch()
    assert watch.changed() is not None  # the first call is the reference
    assert watch.changed() is None


def test_each_generator_moving_is_noticed() -> None:
    watch = RngWatch()
    watch.changed()
    for draw in (lambda: torch.rand(1), random.random, np.random.rand):
        draw()
        assert watch.changed() is not None
        assert watch.changed() is None


def test_numpy_gaussian_cache_used_up_without_moving_the_twister_is_noticed() -> None:
    """numpy's legacy normal() draws two gaussians at once and caches the second: the next
    normal() uses the cache and leaves the twister where it was. A capture that compared only
    the twister would keep the stale cache, and a resumed worker would draw it twice."""
    np.random.seed(0)
    watch = RngWatch()
    watch.changed()
    np.random.normal()  # fills the cache
    after_first = watch.changed()
    assert after_first is not None
    assert after_first.numpy_gauss is not None
    np.random.normal()  # uses the cache up; the twister does not move
    after_second = watch.changed()
    assert after_second is not None
    assert after_second.numpy_gauss is None
    expected = np.random.normal()
    after_second.restore()
    assert np.random.normal() == expected


def test_restore_puts_every_generator_back() -> None:
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    np.random.normal()
    saved = ProcessRng.from_plain(ProcessRng.capture().to_plain())
    expected = (torch.rand(3).tolist(), random.random(), np.random.normal(), np.random.rand())
    saved.restore()
    assert (torch.rand(3).tolist(), random.random(), np.random.normal(), np.random.rand()) == (
        expected
    )


def test_python_gaussian_cache_used_up_without_moving_the_twister_is_noticed() -> None:
    """random.gauss() caches its second value the same way (in ``gauss_next``)."""
    random.seed(0)
    watch = RngWatch()
    watch.changed()
    random.gauss(0, 1)  # (arguments: Python 3.10 has no defaults)
    assert watch.changed() is not None
    random.gauss(0, 1)  # uses the cache; the twister does not move
    after = watch.changed()
    assert after is not None
    assert after.random_gauss is None
    expected = random.gauss(0, 1)
    after.restore()
    assert random.gauss(0, 1) == expected
