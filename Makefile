# Every target does its own set-up: a virtual environment in .venv with the project and its dev extras.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench chaos lint format clean

# uv resolves and installs in seconds what pip takes minutes for; it is itself installed by pip.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip uv
	$(BIN)/python -m uv pip install --quiet --python $(BIN)/python -e '.[dev]'
	touch $(STAMP)

# Frameworks whose pinned dependencies cannot share .venv with the others (README, "Extras"): each gets a
# virtual environment of its own with the project, its extra and the test tools, and its tests under
# tests/isolated/<extra>/ run there. In .venv those tests are skipped, naming the environment that runs them.
ISOLATED ?= crewai google-adk
ISOLATED_STAMPS := $(foreach name,$(ISOLATED),.venv-$(name)/.installed)

.venv-%/.installed: pyproject.toml $(STAMP)
	$(PYTHON) -m venv .venv-$*
	$(BIN)/python -m uv pip install --quiet --python .venv-$*/bin/python -e '.[$*,test]'
	touch $@

demo: $(STAMP)  ## the main job: embedded, no servers needed
	$(BIN)/onceonly demo

TEST_WORKERS ?= 3

test: $(STAMP) $(ISOLATED_STAMPS)  ## the whole suite; Redis/PostgreSQL from ONCEONLY_TEST_REDIS_URL / ONCEONLY_TEST_POSTGRES_URL
	$(BIN)/python -m pytest -n $(TEST_WORKERS)
	@set -e; for name in $(ISOLATED); do \
	  echo "== tests/isolated/$$name in .venv-$$name"; \
	  .venv-$$name/bin/python -m pytest -n 2 tests/isolated/$$name; \
	done

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
	rm -rf $(VENV) .venv-* .pytest_cache .mypy_cache .ruff_cache .onceonly
