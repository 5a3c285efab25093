# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow lint format clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch==2.13.0 resolves to the CPU wheel on these machines; see README.
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/jaxpi demo --out demo_out

test: $(STAMP)
	$(BIN)/pytest -m "not slow" -q

test-slow: $(STAMP)
	$(BIN)/pytest -m slow -q

lint: $(STAMP)
	$(BIN)/ruff check jaxpi sharding tests tools
	$(BIN)/ruff format --check jaxpi sharding tests tools

format: $(STAMP)
	$(BIN)/ruff format jaxpi sharding tests tools
	$(BIN)/ruff check --fix jaxpi sharding tests tools

clean:
	rm -rf demo_out .pytest_cache .ruff_cache
