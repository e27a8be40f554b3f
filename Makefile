# Everything a fresh machine needs comes from here: `make test`, `make demo`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch 2.13.0 (CPU build) is on this kind of machine's local disk; other versions download GBs.
TORCH ?= torch==2.13.0

.PHONY: install test lint demo clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/activate setup.cfg pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check pyro_pdvi tests examples
	$(BIN)/ruff format --check pyro_pdvi tests examples

demo: install
	OMP_NUM_THREADS=1 $(BIN)/python examples/benchmark_gmm_generic.py --out results

clean:
	rm -rf $(VENV) results .pytest_cache
