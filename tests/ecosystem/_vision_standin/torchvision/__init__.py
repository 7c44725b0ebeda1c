"""A stand-in for torchvision, put first on ``sys.path`` by tests/ecosystem/test_streaming.py.

MosaicML Streaming imports its vision datasets (and so torchvision) when it is imported; these
tests use none of them, and the torchvision wheel on these machines does not load with the CPU
build of torch. This package has only the names that import reaches; using any of them raises.
See tests/ecosystem/__init__.py.
"""

STANDIN = True


def unavailable(*args: object, **kwargs: object) -> None:
    raise RuntimeError(
        "this is the test suite's torchvision stand-in (tests/ecosystem/_vision_standin): "
        "the streaming tests use no vision code"
    )
