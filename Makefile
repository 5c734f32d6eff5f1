# The two commands that do everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install run test lint proto clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "scaletrain needs Python 3.11 or newer")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/scaletrain run $(ARGS)

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/ruff format --no-cache --check .

proto: install
	$(PY) -m scaletrain.protogen

clean:
	rm -rf .scaletrain .pytest_cache test-artifacts
