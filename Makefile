# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed

.PHONY: install test test-fast test-sqlite fuzz lint typecheck check demo serve bench bench-quick screenshots docs docs-reference clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

## The whole suite, on SQLite and on PostgreSQL (DELIVERY_TEST_POSTGRES_URL, default the local server).
## Three workers, a test module each at a time (the slowest modules first, tests/conftest.py): on two
## cores two workers left a third of the CPU idle while tests waited on leases, timeouts and servers
## starting; three keep it busy. Where the time goes: docs/design.md, section 11.
## It ends with the line coverage of `delivery` and `flows` (pytest-cov; files fully covered are left
## out of the table, the TOTAL line is the figure). Code run in a subprocess the tests start
## (`delivery serve`, the console script) is not counted. The data file is kept in .venv, out of git.
test: $(STAMP)
	COVERAGE_FILE=$(VENV)/.coverage $(BIN)/python -m pytest -q -n 3 --dist loadfile \
		--cov=delivery --cov=flows --cov-report=term:skip-covered

## The inner loop while working: unit and in-process integration tests on SQLite, no coverage, no
## subprocesses, no Prefect flows run through a server (about 2.5 minutes on this 2-core machine).
## `make test` stays the whole suite: run it before you commit.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 3 tests/unit tests/integration -m "not postgres and not slow and not through_prefect"

## The suite without the PostgreSQL half, for a machine with no PostgreSQL.
test-sqlite: $(STAMP)
	$(BIN)/python -m pytest -q -n 3 --dist loadfile -m "not postgres"

## Only the property-based tests (marked fuzz), with far more examples than `make test` gives them
## (HYPOTHESIS_PROFILE=fuzz; the profiles are registered in tests/conftest.py).
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest -q -m fuzz

lint: $(STAMP)
	$(BIN)/ruff check delivery flows playground tests migrations bench tools
	$(BIN)/ruff format --check delivery flows playground tests migrations bench tools
	$(BIN)/lint-imports  # the import arrows of docs/architecture.md (contracts in pyproject.toml)

typecheck: $(STAMP)
	$(BIN)/mypy

check: lint typecheck test

## The whole engine end to end on the embedded defaults (SQLite, Prefect's local API, a sandbox target).
demo: $(STAMP)
	$(BIN)/delivery demo

## The long-running job on this machine: a local Prefect server, the 5-minute tick and deliver-rule.
serve: $(STAMP)
	$(BIN)/delivery serve

## The benchmark (docs/performance.md). Records: engine vs bare httpx vs naive Prefect at 2 ms and
## 50 ms, grouped and per_record settles, mirror sizes (~15 min; ARGS go to bench.run). Rules: many
## rules per tick on a real Prefect server with process workers (~15-25 min; RULES_ARGS to bench.rules).
bench: $(STAMP)
	$(BIN)/python -m bench.run $(ARGS)
	$(BIN)/python -m bench.rules $(RULES_ARGS)

## Both at tiny sizes (~4 min): CI runs them so the scripts cannot rot.
bench-quick: $(STAMP)
	$(BIN)/python -m bench.run --quick --json bench/results/quick.json
	$(BIN)/python -m bench.rules --quick --json bench/results/rules-quick.json
	$(BIN)/python -m bench.cli --quick --json bench/results/cli-quick.json

## The pictures of docs/operator-guide.md (docs/img/*.png), from the real Prefect UI: `delivery serve`
## in a temp dir, a few runs, headless Chromium (Debian's `chromium`; installed when run as root). ~3 min.
screenshots: $(STAMP)
	$(BIN)/python -m tools.screenshots $(ARGS)

## The documentation site (mkdocs.yml, docs/) into site/, built with --strict: a broken link or anchor,
## or a page left out of the nav, fails it. It first checks that the generated reference pages
## (docs/reference/) match the config models and the CLI; `make docs-reference` rewrites them.
## The site's packages (the `docs` extra, pinned in constraints.txt) are installed on first use.
docs: $(DOCS_STAMP)
	$(BIN)/python -m tools.docs_reference --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet  # the variable silences a banner about Material's successor

$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev,docs]"
	touch $(DOCS_STAMP)

## docs/reference/configuration.md and cli.md, regenerated from delivery/config.py, delivery/settings.py
## and the Typer app (tools/docs_reference.py).
docs-reference: $(STAMP)
	$(BIN)/python -m tools.docs_reference

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
