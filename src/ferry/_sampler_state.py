"""How a built-in sampler's iteration begins, and its state as ``state_dict()`` gives it.

:class:`SamplerRun` records how one iteration of a built-in sampler began (a generator state,
a seed drawn from torch's global RNG) and where it resumes; the loader's resume
(:mod:`ferry._engine.position.keys`) and the samplers' own ``state_dict()``/``load_state_dict()``
(:class:`_IterationState`, the Stateful API of torchdata's samplers) are both made from it.
Split from :mod:`ferry.samplers`, which re-exports what is public.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any, NoReturn, cast

import torch

from ferry._core.rng import generator_from_state, generator_state, set_generator_state

__all__ = ["SamplerRun", "skip_chunks"]


@dataclass
class SamplerRun:
    """One iteration of a built-in sampler: how it began, and where it resumes.

    ``start`` is plain data that fixes the iteration's whole sequence: the generator's state
    when the iteration began drawing (or the seed it drew from torch's global RNG). The sampler
    fills it in when it first draws; given one, the sampler draws the same sequence again
    without touching the global RNG. ``skip`` leading keys are left out (a resume), which costs
    a slice, not a walk through them. A sampler may rewrite ``start`` on resume (a
    :class:`~ferry.DistributedSampler` resumed with another world size does) and then sets
    ``skip`` to 0.
    """

    start: dict[str, Any] | None = None
    skip: int = 0
    # Set on resume when the iteration draws straight from torch's global RNG: the sampler
    # then makes its draw on the global RNG too (and drops it), as a fresh iteration would.
    consume_global: bool = False


def skip_chunks(chunks: Iterator[torch.Tensor], skip: int) -> Iterator[torch.Tensor]:
    """``chunks`` without their first ``skip`` elements (all chunks are still drawn)."""
    for chunk in chunks:
        if skip >= chunk.numel():
            skip -= chunk.numel()
            continue
        yield chunk[skip:] if skip else chunk
        skip = 0


def _run_generator(run: SamplerRun, own: Any, global_draw: bool) -> Any:
    """The generator one iteration draws from, recording (or replaying) how it began.

    ``own`` is the sampler's generator. Without one, a sampler either seeds a fresh generator
    from torch's global RNG (``global_draw=False``: the seed is recorded) or draws straight
    from the global RNG (``global_draw=True``: the global state is recorded, and a resume
    draws from a copy of it, and makes the same draw on the global RNG, dropped).
    """
    if own is not None and not isinstance(own, torch.Generator):
        return own  # not a generator: the draw raises torch's own TypeError for it
    start = run.start
    if start is not None and "global" in start:
        # A fresh iteration whose draws from torch's global RNG come from a copy of it as it
        # stood when the state was taken (see Cursor.global_rng); each is made on the global
        # RNG too, dropped. The start recorded is the one such a draw records.
        copy = generator_from_state(start["global"])
        if own is not None:
            run.start = {"generator": generator_state(own)}
            return own
        if global_draw:
            run.start = {"generator": start["global"]}
            run.consume_global = True
            return copy
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=copy).item())
        torch.empty((), dtype=torch.int64).random_()
        run.start = {"seed": seed}
        return torch.Generator().manual_seed(seed)
    if start is not None:
        # A resumed iteration draws the recorded sequence again. What a fresh iteration draws
        # from torch's global RNG is drawn from it here too, draw for draw, and dropped: the
        # global RNG then stands where a fresh iteration leaves it, for whatever draws next.
        if "seed" in start:
            if own is None:
                torch.empty((), dtype=torch.int64).random_()
            return torch.Generator().manual_seed(int(start["seed"]))
        if own is not None:
            set_generator_state(own, start["generator"])
            return own
        run.consume_global = True
        return generator_from_state(start["generator"])
    if own is not None:
        run.start = {"generator": generator_state(own)}
        return own
    if global_draw:
        run.start = {"generator": generator_state(torch.default_generator)}
        return None
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    run.start = {"seed": seed}
    return torch.Generator().manual_seed(seed)


class _Progress:
    """How far one ``iter(sampler)`` has gone, counted at no cost per key.

    The keys skipped at its start (``run.skip``, read when asked: a sampler may rewrite it as
    it begins), the keys of the chunks before the current one (``before``), and the current
    chunk as a list iterator, whose length hint says how many of its keys are still to come.
    """

    __slots__ = ("before", "current", "run", "size")

    def __init__(self, run: SamplerRun) -> None:
        self.run = run
        self.before = 0
        self.size = 0
        self.current: Iterator[Any] = iter(())

    def enter(self, keys: list[Any]) -> Iterator[Any]:
        """Count the keys of the next chunk: returns the iterator to take them from."""
        self.before += self.size
        self.size = len(keys)
        self.current = iter(keys)
        return self.current

    def yielded(self) -> int:
        """How many keys of the iteration were yielded, those skipped at its start included."""
        return self.run.skip + self.before + self.size - operator.length_hint(self.current)

    def close(self) -> None:
        """Keep the count, let go of the chunk: the iteration ended or was dropped."""
        self.before += self.size - operator.length_hint(self.current)
        self.size = 0
        self.current = iter(())


def _state_int(state: Mapping[str, Any], key: str, meaning: str, minimum: int | None = None) -> int:
    """``state[key]`` as an int (any integer type but ``bool``), at least ``minimum``."""
    value = state[key]
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ValueError(
            f"Invalid state_dict: {key!r} must be an int ({meaning}), got {value!r} "
            f"({type(value).__name__})"
        ) from None
    if minimum is not None and number < minimum:
        raise ValueError(
            f"Invalid state_dict: {key!r} must be at least {minimum} ({meaning}), got {number}"
        )
    return number


class _NotForOwnIteration:
    """``state_dict``/``load_state_dict`` of a sampler subclass that overrides ``__iter__``.

    ferry's sampler state describes the iterations ferry's ``__iter__`` makes; a subclass
    that iterates its own way has none (``hasattr`` is false), unless it defines the method
    itself. A loader then treats it as the stateless sampler it is, as it did before the
    samplers had a state, instead of restoring a state that does not describe its keys.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> NoReturn:
        cls = owner if owner is not None else type(obj)
        base = next(b.__name__ for b in cls.__mro__ if b.__module__ in _OWN)
        raise AttributeError(
            f"{cls.__name__} has no {self.name}: it overrides __iter__, and the state of "
            f"ferry's {base} describes only the iterations ferry's __iter__ makes; define "
            f"state_dict and load_state_dict in {cls.__name__} to make it stateful"
        )


_OWN = frozenset({"ferry.samplers", "ferry.distributed"})  # modules of ferry's samplers


class _IterationState:
    """``state_dict()``/``load_state_dict()`` for the iterations ``iter(sampler)`` makes.

    The state is where the latest such iteration stands: ``"yielded"`` keys so far, and what
    fixes its sequence (its start, as a :class:`SamplerRun` records it, in a subclass's own
    format). A loaded state is kept for the next ``iter(sampler)``, which resumes it. A
    subclass defines how a start reads as state and back, and what the next start would be.
    A user's subclass that overrides ``__iter__`` has no state (see :class:`_NotForOwnIteration`).
    """

    _latest: _Progress | None = None  # the latest iter(self), and how far it has gone
    _resume: SamplerRun | None = None  # a loaded state, for the next iter(self)
    _state_keys: tuple[str, ...] = ()  # the keys besides "yielded" a state may hold

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own_iter = vars(cls).get("__iter__")
        if own_iter is not None and getattr(own_iter, "__module__", None) not in _OWN:
            for name in ("state_dict", "load_state_dict"):
                if name not in vars(cls):
                    setattr(cls, name, _NotForOwnIteration(name))

    def _begin_iteration(self) -> _Progress:
        """Start an ``iter(self)``: the loaded state's resume, or a fresh iteration."""
        run = self._resume if self._resume is not None else SamplerRun()
        self._resume = None
        self._latest = _Progress(run)
        return self._latest

    def state_dict(self) -> dict[str, Any]:
        """Where this sampler's latest ``iter(sampler)`` stands, as plain data.

        ``"yielded"`` counts the indices it yielded; the other keys fix its sequence (see
        the class's docstring). Before any iteration (or once an iteration has begun but not
        drawn yet) it describes the next iteration's start, with ``"yielded": 0``; after
        :meth:`load_state_dict` and before the next ``iter()``, the loaded state. Inside a
        :class:`~ferry.DataLoader`, checkpoint the loader's ``state_dict()`` instead: the
        loader drives the sampler itself, and this state describes only ``iter(sampler)``.

        Example::

            >>> sampler = RandomSampler(range(5), generator=torch.Generator().manual_seed(0))
            >>> it = iter(sampler)
            >>> next(it), next(it)
            (4, 0)
            >>> sorted(sampler.state_dict()), sampler.state_dict()["yielded"]
            (['generator', 'yielded'], 2)
        """
        if self._resume is not None:
            run, yielded = self._resume, self._resume.skip
        elif self._latest is not None:
            run, yielded = self._latest.run, self._latest.yielded()
        else:
            run, yielded = SamplerRun(), 0
        start = run.start if run.start is not None else self._next_start()
        state: dict[str, Any] = {"yielded": yielded}
        if start is not None:
            state.update(self._start_to_state(start))
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next ``iter(sampler)`` continue the saved iteration after ``"yielded"``.

        It yields the rest of the saved sequence (a slice: nothing is yielded and dropped),
        and leaves the generator where the uninterrupted iteration would, so later
        iterations match an uninterrupted run too. torchdata's formats load as well:
        ``{"yielded": k}`` alone skips ``k`` indices of the next, fresh iteration.

        Raises:
            ValueError: ``Invalid state_dict``, naming the key that is missing, unexpected
                or has the wrong value.

        Example::

            >>> def make():
            ...     return RandomSampler(range(5), generator=torch.Generator().manual_seed(0))
            >>> sampler = make()
            >>> it = iter(sampler)
            >>> next(it), next(it)
            (4, 0)
            >>> resumed = make()
            >>> resumed.load_state_dict(sampler.state_dict())
            >>> list(resumed)
            [1, 3, 2]
        """
        name = type(self).__name__
        if not isinstance(state, Mapping):
            raise ValueError(
                f"Invalid state_dict: {name}.load_state_dict takes a dict as state_dict() "
                f"returns, got {type(state).__name__}"
            )
        if "yielded" not in state:
            raise ValueError(
                "Invalid state_dict: the key 'yielded' (how many indices the saved iteration "
                f"had yielded) is missing; got keys {sorted(map(str, state))}"
            )
        unknown = sorted(str(key) for key in state if key not in {"yielded", *self._state_keys})
        if unknown:
            expected = " and ".join(repr(key) for key in ("yielded", *self._state_keys))
            raise ValueError(
                f"Invalid state_dict: unexpected key(s) {unknown} for {name}, whose state "
                f"holds {expected}"
            )
        yielded = _state_int(state, "yielded", "indices the saved iteration yielded", 0)
        start = self._state_to_start(state)
        self._check_yielded(yielded, start)
        self._resume = SamplerRun(start, yielded)

    def _check_yielded(self, yielded: int, start: dict[str, Any] | None) -> None:
        """Refuse a count past the end of an iteration of this sampler."""
        del start  # one iteration's length does not depend on how it began
        length = len(cast(Sized, self))
        if yielded > length:
            raise ValueError(
                f"Invalid state_dict: 'yielded' is {yielded}, more than the {length} indices "
                f"one iteration of this {type(self).__name__} yields; the state was saved by "
                "a sampler built with other arguments"
            )

    def _next_start(self) -> dict[str, Any] | None:
        """The start the next iteration would record, if it is known now."""
        raise NotImplementedError

    def _start_to_state(self, start: dict[str, Any]) -> dict[str, Any]:
        """A recorded start as the keys of a state (besides ``"yielded"``)."""
        raise NotImplementedError

    def _state_to_start(self, state: Mapping[str, Any]) -> dict[str, Any] | None:
        """A state's start (checked), or None where the state leaves it to the iteration."""
        raise NotImplementedError


class _GeneratorState(_IterationState):
    """The state of a sampler whose sequence one ``torch.Generator`` fixes.

    ``"generator"`` is that generator's state when the iteration began drawing (a ``uint8``
    tensor, as ``torch.Generator.get_state()`` returns); for a sampler without a generator,
    the state of the generator it drew from (torch's global one). A :class:`RandomSampler`
    without a generator records ``"seed"`` instead: the seed it drew from torch's global RNG.
    """

    _state_keys: tuple[str, ...] = ("generator",)
    generator: Any

    def _next_start(self) -> dict[str, Any] | None:
        if isinstance(self.generator, torch.Generator):
            return {"generator": generator_state(self.generator)}
        return None  # drawn from torch's global RNG when the iteration begins

    def _start_to_state(self, start: dict[str, Any]) -> dict[str, Any]:
        if "seed" in start:
            return {"seed": int(start["seed"])}
        return {"generator": generator_from_state(start["generator"]).get_state()}

    def _state_to_start(self, state: Mapping[str, Any]) -> dict[str, Any] | None:
        if "seed" in state and "generator" in state:
            raise ValueError(
                "Invalid state_dict: it holds both 'seed' and 'generator'; an iteration "
                "begins from one of them, so give one"
            )
        if "seed" in state:
            seed = _state_int(state, "seed", "the seed the saved iteration drew", -(1 << 63))
            if seed >= 1 << 64:
                raise ValueError(
                    f"Invalid state_dict: 'seed' must be below 2**64 (a torch seed), got {seed}"
                )
            return {"seed": seed}
        if "generator" not in state:
            return None
        value = state["generator"]
        if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
            got = (
                f"a {value.dtype} tensor of shape {tuple(value.shape)}"
                if isinstance(value, torch.Tensor)
                else f"{value!r:.60} ({type(value).__name__})"
            )
            raise ValueError(
                "Invalid state_dict: 'generator' must be a 1-D uint8 tensor, as "
                f"torch.Generator.get_state() returns, got {got}"
            )
        scratch = torch.Generator()
        try:
            scratch.set_state(value.cpu())
        except RuntimeError as exc:
            raise ValueError(
                "Invalid state_dict: 'generator' must be a CPU torch.Generator's state, got "
                f"{value.numel()} bytes that are not one ({exc})"
            ) from None
        return {"generator": generator_state(scratch)}
