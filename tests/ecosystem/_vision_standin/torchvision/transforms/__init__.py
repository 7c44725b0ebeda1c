"""Stand-in for torchvision.transforms (see the package's docstring)."""
