"""The dataset base classes MosaicML Streaming subclasses at import (never instantiated)."""


class VisionDataset:
    def __init__(self, *args: object, **kwargs: object) -> None:
        from torchvision import unavailable

        unavailable()


class CIFAR10(VisionDataset):
    pass
