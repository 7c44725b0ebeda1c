"""Resuming a loader mid-epoch, compared with the run that was not interrupted.

:func:`resume_at_midpoint` runs what a mid-epoch resume test starts from:

1. the uninterrupted run: ``make_loader(1)``, iterated for every epoch compared;
2. the interrupted run: ``make_loader(1)`` again, ``in_epoch`` full epochs, then ``at`` batches
   of the next one (by default half of it) and ``state_dict()``; the state goes through
   ``round_trip`` (JSON by default, as a checkpoint file would take it);
3. the resumed run, as in a new process: ``make_loader(2)`` (or ``resume_with(2)``), its
   generators seeded otherwise, ``load_state_dict(state)``, then the rest of that epoch and the
   epochs after it.

The seed given to ``make_loader`` is for the loader's own generators (a test that seeds
nothing can ignore it). Every loader's persistent workers are let go after its run.

:func:`assert_resumes_exactly` asserts that the batches across the resume are exactly the
uninterrupted run's, batch for batch, with :func:`~_support.compare.assert_same` (container
types, dtypes, shapes, strides, values). Both return a :class:`Resume`, for what a test checks
beside that (the state, what the resumed loader's dataset or sampler saw).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

from _support.compare import assert_same

State = dict[str, Any]

FIRST_SEED = 1
"""The seed of the uninterrupted and the interrupted loaders."""
RESUMED_SEED = 2
"""The seed of the resumed loader (a new process, whose generators start elsewhere)."""


class Resume(NamedTuple):
    """What :func:`resume_at_midpoint` saw. ``uninterrupted`` and ``resumed`` are lists of
    epochs (lists of batches), from the interrupted epoch on: they are equal when the resume
    is exact."""

    uninterrupted: list[list[Any]]
    """The epochs of the uninterrupted loader, from the one interrupted on."""
    resumed: list[list[Any]]
    """The same epochs across the resume: :attr:`delivered`, then what the resumed loader
    gave (:attr:`rest`)."""
    delivered: list[Any]
    """The batches the interrupted loader delivered before its state was taken."""
    rest: list[list[Any]]
    """Each epoch of the resumed loader: the rest of the interrupted epoch, then full ones."""
    state: State
    """The state the resumed loader loaded (after the round trip)."""
    loader: Any
    """The resumed loader."""


def json_round_trip(state: State) -> State:
    """The state through JSON text and back, asserting that it is plain data."""
    loaded: State = json.loads(json.dumps(state))
    assert loaded == state, "the state is not plain data: a JSON round trip changed it"
    return loaded


def stop(loader: Any) -> None:
    """Let go of a loader's persistent workers now, not when the loader is collected."""
    loader._iterator = None


def resume_at_midpoint(
    make_loader: Callable[[int], Any],
    *,
    at: int | None = None,
    epochs: int = 1,
    in_epoch: int = 0,
    resume_with: Callable[[int], Any] | None = None,
    round_trip: Callable[[State], State] | None = json_round_trip,
    before_state: Callable[[Any], object] | None = None,
) -> Resume:
    """Interrupt ``make_loader``'s loader ``at`` batches into epoch ``in_epoch`` (default: half
    of that epoch) and resume a fresh loader from its state for ``epochs`` epochs (the rest of
    the interrupted one included); see the module's docstring.

    ``resume_with`` builds the resumed loader where it differs (another number or kind of
    workers); ``round_trip=None`` loads the state object itself; ``before_state(loader)`` runs
    on the interrupted loader just before ``state_dict()`` (a wait, a check).
    """
    assert epochs >= 1, epochs
    assert in_epoch >= 0, in_epoch
    reference = make_loader(FIRST_SEED)
    passes = [list(reference) for _ in range(in_epoch + epochs)]
    stop(reference)
    del reference
    uninterrupted = passes[in_epoch:]
    if at is None:
        at = len(uninterrupted[0]) // 2
    assert 0 <= at <= len(uninterrupted[0]), f"epoch {in_epoch} has no batch {at}"

    loader = make_loader(FIRST_SEED)
    for _ in range(in_epoch):
        for _ in loader:
            pass
    iterator = iter(loader)
    delivered = [next(iterator) for _ in range(at)]
    if before_state is not None:
        before_state(loader)
    state = loader.state_dict()
    del iterator
    stop(loader)
    del loader
    if round_trip is not None:
        state = round_trip(state)

    fresh = (resume_with or make_loader)(RESUMED_SEED)
    fresh.load_state_dict(state)
    rest = [list(fresh) for _ in range(epochs)]
    stop(fresh)
    resumed = [delivered + rest[0], *rest[1:]]
    return Resume(uninterrupted, resumed, delivered, rest, state, fresh)


def assert_resumes_exactly(make_loader: Callable[[int], Any], **options: Any) -> Resume:
    """:func:`resume_at_midpoint`, asserting that the batches across the resume are exactly
    those of the uninterrupted run (failures name the epoch and batch)."""
    run = resume_at_midpoint(make_loader, **options)
    first = options.get("in_epoch", 0)
    for offset, (want, got) in enumerate(zip(run.uninterrupted, run.resumed, strict=True)):
        assert_same(
            want,
            got,
            f"epoch {first + offset} (resumed after {len(run.delivered)} batches of epoch {first})",
            ("uninterrupted", "resumed"),
        )
    return run
