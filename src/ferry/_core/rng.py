"""Random-generator states as plain data, for the loader's resumable state.

Two kinds of state travel in a :meth:`ferry.DataLoader.state_dict`:

* a ``torch.Generator``'s state (a sampler's or the loader's generator), as a base64 string of
  the bytes ``Generator.get_state()`` returns;
* a worker process's global generators (torch, Python's ``random``, numpy's legacy global
  generator), captured after each batch so a resumed worker draws on exactly where the worker
  of the interrupted run stood after the last batch the user received from it.

Everything here is JSON-safe (strings, ints, floats, None) and loads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import array
import base64
import ctypes
import random
import sys
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ProcessRng",
    "RngWatch",
    "decode_bytes",
    "encode_bytes",
    "generator_from_state",
    "generator_state",
    "ready_to_fork",
    "seed_torch",
    "set_generator_state",
    "tensor_bytes",
]


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of a CPU tensor, copied out without numpy (``tensor.numpy()`` raises where
    numpy is not installed, and numpy is optional). The same bytes as
    ``tensor.numpy().tobytes()``, as fast (a few microseconds for a generator's state), where
    ``bytes(tensor.tolist())`` would take about 100."""
    flat = tensor.contiguous()
    return ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())


def encode_bytes(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def decode_bytes(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def generator_state(generator: torch.Generator) -> str:
    """``generator``'s state as a string (about 6.7 kB for a CPU generator)."""
    return encode_bytes(tensor_bytes(generator.get_state()))


def set_generator_state(generator: torch.Generator, state: str) -> None:
    data = bytearray(decode_bytes(state))
    generator.set_state(torch.frombuffer(data, dtype=torch.uint8).clone())


def generator_from_state(state: str) -> torch.Generator:
    """A new CPU generator in ``state``: also the state of torch's global CPU generator, so a
    draw torch made from its global RNG can be made again without touching the global RNG."""
    generator = torch.Generator()
    set_generator_state(generator, state)
    return generator


@dataclass(frozen=True)
class ProcessRng:
    """The global generators of a worker process: torch's, ``random``'s and numpy's.

    Captured as raw bytes (cheap: a few tens of microseconds per batch); turned into plain data
    only when the main process builds a state dict.
    """

    torch_state: bytes
    random_state: bytes
    random_gauss: float | None
    numpy_state: bytes | None = None
    numpy_pos: int = 0
    numpy_gauss: float | None = None

    @classmethod
    def capture(cls) -> ProcessRng:
        version, words, gauss = random.getstate()
        del version  # always 3 on the Pythons ferry supports
        numpy_state: bytes | None = None
        numpy_pos, numpy_gauss = 0, None
        np = _numpy()
        if np is not None:
            state = np.random.get_state(legacy=False)
            numpy_state = state["state"]["key"].tobytes()
            numpy_pos = int(state["state"]["pos"])
            numpy_gauss = float(state["gauss"]) if state["has_gauss"] else None
        return cls(
            tensor_bytes(torch.get_rng_state()),
            array.array("I", words).tobytes(),
            gauss,
            numpy_state,
            numpy_pos,
            numpy_gauss,
        )

    def restore(self) -> None:
        torch.set_rng_state(torch.frombuffer(bytearray(self.torch_state), dtype=torch.uint8))
        words = array.array("I")
        words.frombytes(self.random_state)
        random.setstate((3, tuple(words), self.random_gauss))
        np = _numpy()
        if np is not None and self.numpy_state is not None:
            key = np.frombuffer(self.numpy_state, dtype=np.uint32).copy()
            has_gauss = self.numpy_gauss is not None
            gauss = self.numpy_gauss if self.numpy_gauss is not None else 0.0
            np.random.set_state(("MT19937", key, self.numpy_pos, int(has_gauss), gauss))

    def to_plain(self) -> dict[str, Any]:
        return {
            "torch": encode_bytes(self.torch_state),
            "random": encode_bytes(self.random_state),
            "random_gauss": self.random_gauss,
            "numpy": None if self.numpy_state is None else encode_bytes(self.numpy_state),
            "numpy_pos": self.numpy_pos,
            "numpy_gauss": self.numpy_gauss,
        }

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> ProcessRng:
        numpy_state = plain["numpy"]
        return cls(
            decode_bytes(plain["torch"]),
            decode_bytes(plain["random"]),
            plain["random_gauss"],
            None if numpy_state is None else decode_bytes(numpy_state),
            int(plain["numpy_pos"]),
            plain["numpy_gauss"],
        )


class RngWatch:
    """Notices when a process's global generators moved, cheaply, and captures them then.

    A full capture costs tens of microseconds, most of it numpy's ``get_state``; a batch that
    drew nothing should not pay it. So each batch compares raw views first: torch's state
    bytes, ``random``'s state tuple, and the bytes of numpy's Mersenne Twister (read in place,
    under a microsecond). numpy's legacy generator also caches a second gaussian, which a draw
    can use up without moving the twister; the cache only ever empties that way, so while it is
    full every batch captures in full.
    """

    def __init__(self) -> None:
        self._last: ProcessRng | None = None
        self._raw: tuple[bytes, Any, Any, bytes | None] | None = None
        self._numpy_view = _numpy_twister_view()
        self._random_view = _random_twister_view()

    def changed(self) -> ProcessRng | None:
        """The generators now, if they moved since the last call (or on the first); else None."""
        raw = (
            tensor_bytes(torch.get_rng_state()),
            self._random_view() if self._random_view is not None else random.getstate(),
            random._inst.gauss_next,  # type: ignore[attr-defined]
            self._numpy_view() if self._numpy_view is not None else None,
        )
        last = self._last
        if (
            last is not None
            and raw == self._raw
            and raw[3] is not None
            and last.numpy_gauss is None
        ):
            return None
        self._raw = raw
        now = ProcessRng.capture()
        if now == last:
            return None
        self._last = now
        return now


def _random_twister_view() -> Any:
    """A function returning the bytes of Python's global ``random`` generator (its position and
    624 words), read in place from the C object (CPython's layout: the object header, an
    ``int`` index, the words); None unless a check against ``random.getstate()`` confirms the
    layout, so another interpreter falls back to ``getstate()``."""
    import ctypes

    instance = getattr(random, "_inst", None)
    if instance is None or sys.implementation.name != "cpython":
        return None
    offset, size = object.__basicsize__, 4 + 624 * 4

    def view() -> bytes:
        return ctypes.string_at(id(instance) + offset, size)

    try:
        data = view()
        words = random.getstate()[1]
        index = int.from_bytes(data[:4], sys.byteorder)
        if index != words[-1] or array.array("I", data[4:]).tolist() != list(words[:624]):
            return None
    except Exception:
        return None
    return view


def _numpy_twister_view() -> Any:
    """A function returning the bytes of numpy's global Mersenne Twister (624 words and the
    position), read in place; None where that cannot be done."""
    np = _numpy()
    if np is None:
        return None
    try:
        import ctypes

        generator = np.random.mtrand._rand._bit_generator
        if type(generator).__name__ != "MT19937":
            return None
        address = generator.ctypes.state_address
    except (AttributeError, ImportError, TypeError):
        return None
    size = 624 * 4 + 4

    def view() -> bytes:
        return ctypes.string_at(address, size)

    return view


def _numpy() -> Any:
    try:
        import numpy as np
    except ImportError:
        return None
    return np


def seed_torch(seed: int) -> None:
    """``torch.manual_seed(seed)``, for a worker as it starts: the same generator states,
    without its cost where torch has nothing but the CPU to seed.

    ``torch.manual_seed`` also queues a seed for every accelerator backend torch may initialise
    later, and each queued call records the stack it came from (``traceback.format_stack``),
    reading the source file of every frame: about 2 ms in a freshly forked worker, whose stack
    holds the whole main process's, on the way to its first batch. A torch built without CUDA,
    MPS, XPU, MTIA and a custom backend can never run those calls, so there only the CPU
    generator is seeded; anywhere else, torch's function is called."""
    if _cpu_only_torch():
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


_CPU_ONLY: list[bool] = []  # whether this torch has no accelerator backend (decided once)


def _cpu_only_torch() -> bool:
    if not _CPU_ONLY:
        try:
            built = any(
                (
                    torch.backends.cuda.is_built(),  # type: ignore[no-untyped-call]
                    torch.backends.mps.is_built(),
                    torch.xpu._is_compiled(),
                    torch.mtia._is_compiled(),
                    hasattr(torch, torch._C._get_privateuse1_backend_name()),
                )
            )
        except Exception:  # a torch that asks other questions: seed as torch does
            built = True
        _CPU_ONLY.append(not built)
    return _CPU_ONLY[0]


def ready_to_fork() -> None:
    """Import here, once, what every forked worker would otherwise import as it starts: numpy
    loads ``numpy.random`` on its first use, which each worker made when it seeded it (about
    9 ms before its first fetch, on the way to the first batch). Called as a loader with
    process workers is made, and before workers are forked."""
    _cpu_only_torch()
    if "numpy" in sys.modules and "numpy.random" not in sys.modules:
        import numpy.random  # noqa: F401
