"""The workloads of ``python -m ferry bench``: datasets made on the fly, nothing downloaded.

Each :class:`Workload` describes one kind of training input. Its data is made once per
benchmark (:meth:`Workload.prepare`) and shared by both loaders, so torch and ferry read the very
same bytes; each loader then gets a dataset built from its own library's classes
(:meth:`Workload.dataset`), as a user switching ``from torch.utils.data import ...`` to
``from ferry import ...`` would have it.

The dataset classes are module-level so that spawn workers can unpickle them. The stream
workload must subclass the ``IterableDataset`` of the library under test, and this module may
not import ``torch.utils.data`` at import time (ferry never depends on it), so
:class:`TorchStream` and :class:`FerryStream` are made on first access (PEP 562 ``__getattr__``
below); pickle finds them the same way in a worker.
"""

from __future__ import annotations

import importlib
import io
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "WORKLOADS",
    "DictSamples",
    "ImagePool",
    "JpegCrops",
    "JpegFiles",
    "LoaderAPI",
    "SlowReads",
    "StreamSource",
    "Workload",
    "stream_class",
]

_IMAGE_SHAPE = (3, 224, 224)
_JPEG_SOURCE_SIDE = 256
_STREAM_WIDTH = 256
_READ_BYTES = 64 << 10  # what one slow read returns


@dataclass(frozen=True)
class LoaderAPI:
    """The names a workload needs from one data-loading library (torch's or ferry's).

    Attributes:
        name: ``"torch"`` or ``"ferry"``; also picks the stream dataset's base class.
        DataLoader: the loader class under test.
        TensorDataset: that library's ``TensorDataset``.
        get_worker_info: that library's ``get_worker_info`` (a worker asks its own library).
    """

    name: str
    DataLoader: Any
    TensorDataset: Any
    get_worker_info: Callable[[], Any]


class ImagePool:
    """Map-style: sample ``i`` is a view of a preallocated uint8 image, ``pool[i % len(pool)]``.

    Models decoded images already in memory: the loader's own cost is all that is measured.
    """

    def __init__(self, pool: Any, length: int) -> None:
        self.pool = pool
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.pool[index % len(self.pool)]


class DictSamples:
    """Map-style: sample ``i`` is ``{"x": float32[32], "label": int, "name": str}``.

    Models the common dict-of-fields sample whose collate walks a mapping and keeps strings as
    a list.
    """

    def __init__(self, features: Any, length: int) -> None:
        self.features = features
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {
            "x": self.features[index % len(self.features)],
            "label": index % 1000,
            "name": f"sample-{index}",
        }


class JpegFiles:
    """Map-style: sample ``i`` is JPEG bytes decoded and resized to 224x224 by Pillow, as uint8 CHW.

    Models the CPU-bound image pipeline where per-sample work dominates and workers pay off.
    """

    def __init__(self, files: list[bytes], length: int) -> None:
        self.files = files
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        import numpy as np
        from PIL import Image

        with Image.open(io.BytesIO(self.files[index % len(self.files)])) as image:
            resized = image.convert("RGB").resize(_IMAGE_SHAPE[1:], Image.Resampling.BILINEAR)
        return torch.from_numpy(np.array(resized)).permute(2, 0, 1)


class JpegCrops:
    """Map-style: sample ``i`` is a photo-sized JPEG decoded by Pillow, then a random crop of
    8-100% of its area (aspect 3/4 to 4/3) resized to 224x224, flipped half the time: uint8 CHW.

    Models the most common training input: the ImageNet-style augmentation pipeline, CPU-bound
    in Pillow. The crop and flip of sample ``i`` are drawn from ``random.Random(i)``, so every
    loader (and the roof of the scaling mode) does the very same work for the same index.
    """

    def __init__(self, files: list[bytes], length: int) -> None:
        self.files = files
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        import numpy as np
        from PIL import Image

        draw = random.Random(index)
        with Image.open(io.BytesIO(self.files[index % len(self.files)])) as image:
            rgb = image.convert("RGB")
        box = _crop_box(rgb.width, rgb.height, draw)
        out = rgb.resize(_IMAGE_SHAPE[1:], Image.Resampling.BILINEAR, box=box)
        if draw.random() < 0.5:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.asarray(out).copy()).permute(2, 0, 1)


def _crop_box(width: int, height: int, draw: random.Random) -> tuple[int, int, int, int]:
    """A random box of 8-100% of the area with aspect ratio 3/4 to 4/3 (the whole image when
    ten draws do not fit), as ``(left, top, right, bottom)``."""
    area = width * height
    for _ in range(10):
        target = area * draw.uniform(0.08, 1.0)
        aspect = math.exp(draw.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left, top = draw.randint(0, width - w), draw.randint(0, height - h)
            return left, top, left + w, top + h
    return 0, 0, width, height


class SlowReads:
    """Map-style: sample ``i`` waits ``latency_s``, then builds a 64 KiB uint8 array.

    Models I/O-bound data (a network or object-store read per sample): the wait is a
    ``time.sleep``, which releases the GIL as a socket read does, so the loader's concurrency,
    not the CPU, sets the pace. A sample is ``(i, array)`` with the array filled with
    ``i % 251``; the index lets the benchmark check that every sample arrives exactly once.
    ``sleep`` is injectable so that tests need not wait.
    """

    def __init__(
        self, latency_s: float, length: int, sleep: Callable[[float], object] = time.sleep
    ) -> None:
        self.latency_s = latency_s
        self.length = length
        self.sleep = sleep

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[int, Any]:
        import numpy as np

        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} samples")
        self.sleep(self.latency_s)
        return index, np.full(_READ_BYTES, index % 251, dtype=np.uint8)


def sample_indices(batch: Sequence[Any]) -> list[int]:
    """The sample indices of a collated :class:`SlowReads` batch (its first field)."""
    indices: list[int] = batch[0].tolist()
    return indices


class StreamSource:
    """Iterable-style body: yields ``length`` float32[256] arrays from a preallocated pool.

    Under workers, worker ``k`` of ``n`` yields the ``k``-th contiguous share, found through the
    ``get_worker_info`` of the library under test (passed in, since each library tracks its own
    workers). Mixed into each library's ``IterableDataset`` by :func:`stream_class`.
    """

    def __init__(self, pool: Any, length: int, get_worker_info: Callable[[], Any]) -> None:
        self.pool = pool
        self.length = length
        self.get_worker_info = get_worker_info

    def __iter__(self) -> Iterator[Any]:
        start, stop = 0, self.length
        info = self.get_worker_info()
        if info is not None:
            share = -(-self.length // info.num_workers)
            start, stop = info.id * share, min((info.id + 1) * share, self.length)
        pool, size = self.pool, len(self.pool)
        for index in range(start, stop):
            yield pool[index % size]


# The stream dataset's base class lives in the library under test; see the module docstring.
_STREAM_BASES = {"TorchStream": "torch.utils.data", "FerryStream": "ferry"}


def __getattr__(name: str) -> type:
    """Make ``TorchStream`` / ``FerryStream`` on first access (also from pickle in a worker)."""
    if name not in _STREAM_BASES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    base = importlib.import_module(_STREAM_BASES[name]).IterableDataset
    cls = type(name, (StreamSource, base), {"__module__": __name__, "__qualname__": name})
    globals()[name] = cls
    return cls


def stream_class(api: LoaderAPI) -> type:
    """The stream dataset class for ``api``: ``StreamSource`` on that library's IterableDataset."""
    cls: type = __getattr__("TorchStream" if api.name == "torch" else "FerryStream")
    return cls


@dataclass(frozen=True)
class Workload:
    """One benchmark input: how to make its data and how to wrap it for a loader.

    Attributes:
        name: short, stable name used by ``--only``.
        summary: one line for ``--help`` and the report.
        batch_size: default batch size (``--batch-size`` overrides it).
        batches: batches per run in a full run; ``quick_batches`` under ``--quick``.
        shuffle: the loader's ``shuffle`` argument.
        prepare: ``(samples, quick) -> data`` made once and shared by both loaders.
        build: ``(data, samples, api) -> dataset`` made once per loader.
        quick_batch_size: the batch size under ``--quick`` when it differs (slow samples).
        latency_s: the wait of each sample, for a workload bound by I/O latency; the report
            sets the measured rate beside what the loader's concurrency allows at it.
        keys: ``batch -> sample indices``; when given, every run checks that each index
            arrives exactly once (and, over a whole epoch, that every index arrives).
        short_batches: batches per run in the default run when fewer than ``batches``; the
            full count runs with ``--io`` (the I/O-latency rows: seconds of waiting a run).
    """

    name: str
    summary: str
    batch_size: int
    batches: int
    quick_batches: int
    shuffle: bool
    prepare: Callable[[int, bool], Any]
    build: Callable[[Any, int, LoaderAPI], Any]
    quick_batch_size: int | None = None
    latency_s: float | None = None
    keys: Callable[[Any], list[int]] | None = None
    short_batches: int | None = None

    def dataset(self, data: Any, samples: int, api: LoaderAPI) -> Any:
        """The dataset of ``samples`` samples over ``data``, built from ``api``'s classes."""
        return self.build(data, samples, api)


def _rng() -> Any:
    try:
        import numpy as np
    except ImportError:
        raise ImportError(
            "this workload needs numpy: pip install numpy (ferry-data's extra 'bench' has it)"
        ) from None
    return np.random.default_rng(0)


def _prepare_tensor(samples: int, quick: bool) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 32, generator=generator)
    y = torch.randint(0, 1000, (samples,), generator=generator)
    return x, y


def _prepare_images(samples: int, quick: bool) -> Any:
    pool = min(samples, 32 if quick else 256)
    return _rng().integers(0, 256, (pool, *_IMAGE_SHAPE), dtype="uint8")


def _prepare_features(samples: int, quick: bool) -> Any:
    return _rng().standard_normal((min(samples, 4096), 32), dtype="float32")


def _prepare_stream(samples: int, quick: bool) -> Any:
    return _rng().standard_normal((min(samples, 4096), _STREAM_WIDTH), dtype="float32")


def _pillow_image() -> Any:
    """Pillow's Image module, or an ImportError that says where to get it."""
    try:
        from PIL import Image
    except ImportError:
        raise ImportError(
            "the jpeg workload needs Pillow: pip install pillow (ferry-data's extra 'bench' has it)"
        ) from None
    return Image


def _prepare_jpegs(samples: int, quick: bool) -> list[bytes]:
    """~100 distinct 256x256 JPEGs: smooth patterns plus noise, about 35 KB each."""
    rng = _rng()
    import numpy as np

    Image = _pillow_image()
    rows, cols = np.mgrid[0:_JPEG_SOURCE_SIDE, 0:_JPEG_SOURCE_SIDE]
    files = []
    for k in range(min(samples, 20 if quick else 100)):
        planes = [(cols * (k % 7 + 1) + rows), rows * (k % 5 + 1), (cols + rows * (k % 3 + 1))]
        pixels = np.stack(planes, axis=-1) % 224 + rng.integers(0, 32, (*rows.shape, 3))
        encoded = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8)).save(encoded, "JPEG", quality=90)
        files.append(encoded.getvalue())
    return files


def _prepare_photos(samples: int, quick: bool) -> list[bytes]:
    """Photo-sized JPEGs (about 500x375, the ImageNet average, sizes varying by a quarter):
    smooth gradients and blobs under fine noise, quality 90; 48 distinct files (8 quick)."""
    rng = _rng()
    import numpy as np

    Image = _pillow_image()
    files = []
    for _ in range(8 if quick else 48):
        width, height = int(rng.integers(400, 625)), int(rng.integers(300, 470))
        rows, cols = np.mgrid[0:height, 0:width].astype(np.float32)
        planes = []
        for _ in range(3):  # one pattern per channel
            fx, fy = rng.uniform(0.005, 0.04, 2).tolist()
            phase = float(rng.uniform(0, 6.3))
            wave = np.sin(cols * fx + phase) * np.cos(rows * fy - phase)
            planes.append(128 + 80 * wave + rng.normal(0, 12, (height, width)))
        pixels = np.clip(np.stack(planes, axis=-1), 0, 255).astype(np.uint8)
        encoded = io.BytesIO()
        Image.fromarray(pixels).save(encoded, "JPEG", quality=90)
        files.append(encoded.getvalue())
    return files


def _prepare_nothing(samples: int, quick: bool) -> None:
    return None


def _io_workload(latency_ms: int) -> Workload:
    """``io<L>``: :class:`SlowReads` at L ms, batch 32, 1,024 samples with ``--io`` and 256
    without (quick: 2 batches of 4)."""
    latency_s = latency_ms / 1000
    return Workload(
        name=f"io{latency_ms}",
        summary=f"{latency_ms} ms wait (sleep: a network read) + a 64 KiB array per sample",
        batch_size=32,
        batches=32,
        quick_batches=2,
        shuffle=True,
        prepare=_prepare_nothing,
        build=lambda data, samples, api: SlowReads(latency_s, samples),
        quick_batch_size=4,
        latency_s=latency_s,
        keys=sample_indices,
        short_batches=8,
    )


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload(
            name="tensor",
            summary="TensorDataset(float32[N,32], int64[N]), shuffled",
            batch_size=256,
            batches=500,
            quick_batches=200,
            shuffle=True,
            prepare=_prepare_tensor,
            build=lambda data, samples, api: api.TensorDataset(*data),
        ),
        Workload(
            name="image",
            summary="uint8 3x224x224 numpy images from a preallocated pool",
            batch_size=64,
            batches=200,
            quick_batches=24,
            shuffle=True,
            prepare=_prepare_images,
            build=lambda data, samples, api: ImagePool(data, samples),
        ),
        Workload(
            name="dict",
            summary='{"x": float32[32], "label": int, "name": str} samples',
            batch_size=128,
            batches=400,
            quick_batches=100,
            shuffle=True,
            prepare=_prepare_features,
            build=lambda data, samples, api: DictSamples(data, samples),
        ),
        Workload(
            name="jpeg",
            summary="JPEG bytes decoded and resized to 224x224 by Pillow, uint8 CHW",
            batch_size=32,
            batches=30,
            quick_batches=8,
            shuffle=True,
            prepare=_prepare_jpegs,
            build=lambda data, samples, api: JpegFiles(data, samples),
        ),
        Workload(
            name="stream",
            summary="IterableDataset of float32[256] arrays, split across workers",
            batch_size=256,
            batches=500,
            quick_batches=160,
            shuffle=False,
            prepare=_prepare_stream,
            build=lambda data, samples, api: stream_class(api)(data, samples, api.get_worker_info),
        ),
        _io_workload(10),
        _io_workload(50),
    ]
}
