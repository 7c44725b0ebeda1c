"""ferry inside the libraries users train with: Lightning, accelerate, transformers, HF datasets,
MosaicML Streaming, litdata.

Every test runs the same program twice, once with ``torch.utils.data`` and once with ferry,
and compares what the training saw (batches, losses, weights) exactly.

MosaicML Streaming and litdata (test_streaming.py) are installed apart from the ``ecosystem``
extra, without their declared requirements (``streaming-requirements.txt``, installed by the
Makefile with ``pip install --no-deps``): mosaicml-streaming 0.13.0 asks for transformers<5,
which the extra's transformers pin rules out, and both ask for torchvision. The torchvision
wheel on the package index does not load with the CPU build of torch these machines carry
(``import torchvision`` fails: "operator torchvision::nms does not exist"), and MosaicML
Streaming imports its vision datasets, and so torchvision, as it is imported. The tests use no
vision code, so their programs (``_streaming_programs.py``, each run in an interpreter of its
own) put ``_vision_standin/`` first on ``sys.path``: a ``torchvision`` package with only the
names that import reaches. It is never on the path of the pytest process itself, where it
would make other libraries (transformers checks for torchvision) take it for the real one,
and a worker started with spawn or forkserver gets the parent's ``sys.path``, so it imports
the stand-in too.
"""
