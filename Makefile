# Two entry points for a fresh clone: `make test` and `make bench`.
# Each builds the virtual environment in .venv on first use, with $(PYTHON) (Python >= 3.10
# with venv and pip; `make test PYTHON=python3.11` picks another).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: test test-fast test-nonumpy lint typecheck unit bench bench-quick bench-io bench-scaling clean

# The interpreter is checked before anything is made. A .venv without .installed is what a
# failed or interrupted set-up left: it is made afresh. A failed first install removes .venv.
$(VENV)/.installed: pyproject.toml tests/ecosystem/streaming-requirements.txt
	@$(PYTHON) -c 'import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 10))' \
	  >/dev/null 2>&1 || { \
	  echo "make: the development set-up needs Python >= 3.10 with its venv module;" \
	    "PYTHON=$(PYTHON): $$($(PYTHON) -c 'import platform; print("Python " + platform.python_version())' \
	    2>/dev/null || echo 'not found')." >&2; \
	  echo "make: name another interpreter, for example: make test PYTHON=python3.11" >&2; \
	  exit 1; }
	@[ -e $@ ] || rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,bench,ecosystem]' \
	  || { [ -e $@ ] || rm -rf $(VENV); exit 1; }
	@# MosaicML Streaming and litdata, without their declared requirements (the file says why)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps \
	  -r tests/ecosystem/streaming-requirements.txt \
	  || { [ -e $@ ] || rm -rf $(VENV); exit 1; }
	touch $@

lint: $(VENV)/.installed
	$(PY) -m ruff check src tests examples scripts
	$(PY) -m ruff format --check src tests examples scripts

typecheck: $(VENV)/.installed
	$(PY) -m mypy

# The suite runs in $(TEST_PROCS) pytest-xdist processes, a whole file at a time (--dist
# loadfile): most tests wait on the processes and threads they start, so two at a time nearly
# halve the wall time on 2 cores. TEST_PROCS=0 runs every test in pytest's own process.
TEST_PROCS ?= 2
XDIST = -n $(TEST_PROCS) --dist loadfile

# The test sessions keep what Python compiles (__pycache__, ignored by git) even where the
# environment says not to (PYTHONDONTWRITEBYTECODE=1, as on some CI images): otherwise each
# xdist process of each session rewrites the asserts of every test module again (6 of its 11 s
# of collection on 2 cores), and each spawned worker and test program compiles the modules it
# imports again (up to a second each).
PYTEST = PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -p no:cacheprovider

# Two sessions: the tests that import a training framework (Lightning, transformers, ...) into
# the pytest process run last, in their own, so that the processes forking the others' workers
# stay half the size (tests/conftest.py, FRAMEWORK_FILES). Both run; either failing fails.
unit: $(VENV)/.installed
	@status=0; \
	echo "$(PYTEST) $(XDIST) --frameworks=apart"; \
	$(PYTEST) $(XDIST) --frameworks=apart || status=1; \
	echo "$(PYTEST) $(XDIST) --frameworks=only"; \
	$(PYTEST) $(XDIST) --frameworks=only || status=1; \
	exit $$status

test: lint typecheck unit test-nonumpy

# numpy is optional: the loader, sampler and resume tests, the worker tests of seeding, restarts,
# skips, options, threads and hand-off (those not marked slow), and the README's Quickstart
# (tests/test_no_numpy.py) run where numpy cannot be imported. The blocker,
# tests/_support/no_numpy/sitecustomize.py, runs as each interpreter starts, before torch;
# worker processes and subprocesses inherit it through PYTHONPATH. About a minute on 2 cores.
NONUMPY_TESTS := tests/test_no_numpy.py tests/test_loader.py tests/test_samplers.py \
  tests/test_sampler_state.py tests/resume tests/workers/test_info.py \
  tests/workers/test_restarts.py tests/workers/test_skip.py tests/workers/test_options.py \
  tests/workers/test_threads.py tests/workers/test_zero_copy.py
test-nonumpy: $(VENV)/.installed
	PYTHONPATH=$(CURDIR)/tests/_support/no_numpy FERRY_TESTS_WITHOUT_NUMPY=1 \
	  $(PYTEST) $(XDIST) -m "not slow" \
	  --ignore=tests/resume/test_rng.py $(NONUMPY_TESTS)

# The fast loop: lint, types, and the tests not marked slow (the slow suites are listed in
# tests/conftest.py); CI and `make test` run them all.
test-fast: lint typecheck
	$(PYTEST) $(XDIST) -m "not slow"

# `make bench`: every workload family, about 2 minutes on 2 idle cores. The heavier rows are
# their own targets: bench-io (io10 and io50 at full size, about 8 minutes on 2 cores) and
# bench-scaling (jpeg and uint8 at 1, 2, 4, ... workers against the roof; a few minutes).
bench: $(VENV)/.installed
	$(PY) -m ferry bench --json bench-results/bench.json --plot bench-results/bench.png

bench-quick: $(VENV)/.installed
	$(PY) -m ferry bench --quick

bench-io: $(VENV)/.installed
	$(PY) -m ferry bench --io --json bench-results/bench-io.json --plot bench-results/bench-io.png

bench-scaling: $(VENV)/.installed
	$(PY) -m ferry bench --scaling --json bench-results/scaling.json \
	  --markdown bench-results/scaling.md

clean:
	rm -rf $(VENV) build dist .mypy_cache .ruff_cache
