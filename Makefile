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

# What `make run` trains on: the example dataset (stdlib sources, a BPE trained in seconds),
# made once, with its held-out part for the validation loss.
DATA := .scaletrain/data

run: install
	$(VENV)/bin/scaletrain data example --out $(DATA)
	$(VENV)/bin/scaletrain run --data $(DATA)/train --document-masking \
		--eval-data $(DATA)/heldout --eval-every 50 $(ARGS)

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/ruff format --no-cache --check .

proto: install
	$(PY) -m scaletrain.protogen

clean:
	rm -rf .scaletrain .pytest_cache test-artifacts
