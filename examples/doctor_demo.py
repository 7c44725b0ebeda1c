"""A dataset that decodes and augments every sample in ``__getitem__``: a case for the doctor.

    .venv/bin/python -m ferry doctor examples/doctor_demo.py:make_loader --try

(or ``.venv/bin/python examples/doctor_demo.py``, which runs the same command).
"""

from __future__ import annotations

import sys
import time
import zlib

import torch
import torch.nn.functional as F

import ferry

_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
_STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def _smooth_image(size: int, generator: torch.Generator) -> torch.Tensor:
    """A 3 x size x size uint8 image with some structure (compresses like a photo, unlike noise)."""
    coarse = torch.rand(1, 3, 12, 12, generator=generator)
    image = F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)[0]
    return (image.clamp(0, 1) * 255).to(torch.uint8)


class CompressedImages(ferry.Dataset[tuple[torch.Tensor, int]]):
    """Images kept compressed on network storage, then per sample: read (a 2 ms round trip,
    slept here), decoded (zlib: PNG's codec, and nothing beyond the standard library), randomly
    cropped and flipped, normalized.

    One sample per ``__getitem__`` call, and no ``__getitems__``: the common way to write it.
    """

    def __init__(
        self, length: int = 2048, size: int = 256, crop: int = 224, latency_s: float = 0.002
    ) -> None:
        generator = torch.Generator().manual_seed(0)
        self.length, self.size, self.crop, self.latency_s = length, size, crop, latency_s
        # 64 distinct files, read round-robin: enough to decode for real, quick to make.
        self.files = [
            zlib.compress(_smooth_image(size, generator).numpy().tobytes()) for _ in range(64)
        ]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.latency_s)  # the read's round trip to the storage
        raw = zlib.decompress(self.files[index % len(self.files)])
        image = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(3, self.size, self.size)
        top, left = torch.randint(0, self.size - self.crop + 1, (2,)).tolist()
        image = image[:, top : top + self.crop, left : left + self.crop]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return (image.float() / 255 - _MEAN) / _STD, index % 10


def make_loader() -> ferry.DataLoader[tuple[torch.Tensor, int]]:
    """What the doctor calls: the loader as a training script would build it."""
    return ferry.DataLoader(
        CompressedImages(), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0)
    )


if __name__ == "__main__":
    from ferry.__main__ import main

    sys.exit(main(["doctor", f"{__file__}:make_loader", "--try", *sys.argv[1:]]))
