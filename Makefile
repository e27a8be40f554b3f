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
	$(BIN)/ruff check pyro_pdvi tests examples benchmarks
	$(BIN)/ruff format --check pyro_pdvi tests examples benchmarks

# A reduced run of the flagship benchmark (benchmarks/gmm_biased_batches.py; the full one is in
# docs/benchmarks.md): N = 10,000 in blocks of 1,000, 15 epochs, one seed, one learning rate per
# Pyro optimizer. Prints the table, writes results/gmm_biased_batches{.csv,_table.csv,.png}.
demo: install
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/gmm_biased_batches.py --num-data 10000 --epochs 15 \
		--purities 0.95,1.0 --seeds 0 --adam-lrs 0.1 --rmsprop-lrs 0.03 --sgd-lrs 0.1 \
		--ng-decaying 1:0.7 --ng-constant 0.1 --curvature-blocks 2 \
		--generic-num-data 2000 --generic-epochs 5 --quiet --out results

clean:
	rm -rf $(VENV) results .pytest_cache
