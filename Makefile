# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-sqlite lint typecheck check demo serve bench bench-quick clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

## The whole suite, on SQLite and on PostgreSQL (DELIVERY_TEST_POSTGRES_URL, default the local server).
test: $(STAMP)
	$(BIN)/python -m pytest -q

## The suite without the PostgreSQL half, for a machine with no PostgreSQL.
test-sqlite: $(STAMP)
	$(BIN)/python -m pytest -q -m "not postgres"

lint: $(STAMP)
	$(BIN)/ruff check delivery flows tests migrations bench
	$(BIN)/ruff format --check delivery flows tests migrations bench

typecheck: $(STAMP)
	$(BIN)/mypy

check: lint typecheck test

## The whole engine end to end on the embedded defaults (SQLite, Prefect's local API, a sandbox target).
demo: $(STAMP)
	$(BIN)/delivery demo

## The long-running job on this machine: a local Prefect server, the 5-minute tick and deliver-rule.
serve: $(STAMP)
	$(BIN)/delivery serve

## The benchmark (docs/performance.md): engine vs bare httpx vs naive Prefect, mirror sizes. ~8-20 min.
bench: $(STAMP)
	$(BIN)/python -m bench.run $(ARGS)

## The same at tiny sizes (~1 min): CI runs it so the script cannot rot.
bench-quick: $(STAMP)
	$(BIN)/python -m bench.run --quick --json bench/results/quick.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
