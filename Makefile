# Two commands do all the set-up: `make quickstart` (the main job) and `make test` (what CI
# runs: everything, two test processes). `make test-fast` is the unit tier for the edit loop:
# no Ray, no service, no sweep, no fuzz corpus (tests/conftest.py marks the rest).
# `make clean` deletes the results (MLflow store, sweep folders) to start over; the venv stays
# (`make clean-venv` removes it).
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CIFAR-10 copy beside the checkout, unless DPIVON_DATA already points somewhere.
DPIVON_DATA ?= $(abspath $(firstword $(wildcard ../shared/data/cifar10-jpeg.tar.gz)))
export DPIVON_DATA

.PHONY: quickstart test test-fast lint venv ui clean clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# The quickstart's sweep state (pipelines/quickstart.yaml: storage_path dpivon-runs).
QUICKSTART_STATE := dpivon-runs/quickstart/sweep.json

# Run again, the quickstart resumes its sweep: a finished one trains nothing and prints its
# front again; an interrupted one finishes.
quickstart: $(STAMP)
	@if [ -e $(QUICKSTART_STATE) ]; then \
	    echo "make quickstart: resuming the quickstart sweep of $(QUICKSTART_STATE) (to start over: make clean)"; \
	    $(BIN)/dpivon sweep pipelines/quickstart.yaml --resume; \
	else \
	    $(BIN)/dpivon sweep pipelines/quickstart.yaml; \
	fi

# ruff's linter and its formatter (the code is kept as `ruff format .` writes it).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

test-fast: lint
	$(BIN)/python -m pytest -q -n 2 -m "not slow and not integration"

ui: $(STAMP)
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow.db --port 5000

clean:
	rm -rf mlflow.db mlartifacts dpivon-runs

clean-venv:
	rm -rf $(VENV)
