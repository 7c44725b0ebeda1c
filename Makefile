# Two entry points for a fresh clone: `make test` and `make bench`.
# Each builds the virtual environment in .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: test lint typecheck unit bench bench-quick clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,bench,ecosystem]'
	touch $@

lint: $(VENV)/.installed
	$(PY) -m ruff check src tests examples scripts
	$(PY) -m ruff format --check src tests examples scripts

typecheck: $(VENV)/.installed
	$(PY) -m mypy

unit: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider

test: lint typecheck unit

bench: $(VENV)/.installed
	$(PY) -m ferry bench --json bench-results/bench.json --plot bench-results/bench.png

bench-quick: $(VENV)/.installed
	$(PY) -m ferry bench --quick

clean:
	rm -rf $(VENV) build dist .mypy_cache .ruff_cache
