# Every target does its own set-up: a virtual environment in .venv with the project and its dev extras.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench chaos lint format clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)  ## the main job: embedded, no servers needed
	$(BIN)/onceonly demo

TEST_WORKERS ?= 3

test: $(STAMP)  ## the whole suite; Redis/PostgreSQL from ONCEONLY_TEST_REDIS_URL / ONCEONLY_TEST_POSTGRES_URL
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

bench: $(STAMP)  ## per-call overhead per store next to the store's own floor
	$(BIN)/python benchmarks/bench.py

chaos: $(STAMP)  ## the fault matrix (about 3 min): each fault, then all together, per store; make test runs its --short form
	$(BIN)/python -m tests.chaos

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix src tests benchmarks examples
	$(BIN)/ruff format src tests benchmarks examples

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .onceonly
