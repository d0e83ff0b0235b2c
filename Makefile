# Two commands do all the set-up: `make quickstart` (the main job) and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CIFAR-10 copy beside the checkout, unless DPIVON_DATA already points somewhere.
DPIVON_DATA ?= $(firstword $(wildcard ../shared/data/cifar10-jpeg.tar.gz))
export DPIVON_DATA

.PHONY: quickstart test lint venv ui clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/dpivon sweep pipelines/quickstart.yaml

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

ui: $(STAMP)
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow.db --port 5000

clean:
	rm -rf $(VENV) mlflow.db mlartifacts dpivon-runs
