"""Stand-in for torchvision.transforms.functional (see the package's docstring)."""

from torchvision import unavailable

to_tensor = unavailable
