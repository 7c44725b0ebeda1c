#!/usr/bin/env bash
# The test suite on another torch release, or another Python: ferry accepts torch 2.1 and later
# and Python 3.10 and later (pyproject.toml); CI runs only torch 2.13.0 on Python 3.11.
#
#   scripts/test_torch.sh VERSION [PYTEST ARGS...]      e.g. scripts/test_torch.sh 2.5.1
#   PYTHON=python3.13 scripts/test_torch.sh 2.13.0
#
# Builds .venv-torch-VERSION-pyX.Y (once) with that torch, the test tools and ferry (editable),
# then runs the suite there, two files at a time as `make test` does. tests/ecosystem is left out:
# Lightning, accelerate and transformers pin torch releases of their own. Tests whose oracle is
# a torch behaviour the release lacks skip, each with its reason
# (tests/_support/torch_versions.py); everything else must pass.
#
# Cost: from PyPI, torch is a CUDA build (the development pin's CPU build lies on these machines
# for Python 3.11 only), 4 to 5 GB in the venv with its NVIDIA libraries (about 2 minutes to
# install at 60 MB/s); the suite takes 5 minutes on 2 cores. Environment: PYTHON (default python3).
set -eu

version="${1:?usage: scripts/test_torch.sh VERSION [PYTEST ARGS...]}"
shift
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
venv=".venv-torch-$version-py$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"

if [ ! -e "$venv/.installed" ]; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
    # numpy 2 came with torch 2.4's wheels; older ones were built against numpy 1.
    numpy="numpy"
    if "$python" -c "import sys; v = tuple(map(int, sys.argv[1].split('.')[:2])); sys.exit(v >= (2, 4))" "$version"; then
        numpy="numpy<2"
    fi
    "$venv/bin/pip" install --quiet --disable-pip-version-check "torch==$version" "$numpy" \
        pillow matplotlib psutil requests "pytest>=8" "pytest-timeout>=2.2" "pytest-xdist>=3.5" \
        "hypothesis>=6.100"
    # StatefulDataLoader, the resume oracle; its declared torch requirement is not the point.
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "torchdata==0.11.0"
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -e .
    touch "$venv/.installed"
fi

"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile \
    --ignore=tests/ecosystem "$@"
