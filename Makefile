# Titan: `make demo` runs the main job on its embedded default, `make test` the test suite.
# Both create ./.venv and install what they need first (quick when already installed).

PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo pretrain test lint format system-deps clean

$(BIN)/python:
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) (Python 3.11)"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# slime's and miles' own code (unchanged wheels in ../shared/peers) for adapters/: installed
# without their declared dependencies, which pin versions that clash with ours or need a GPU.
PEERS := $(wildcard ../shared/peers/*.whl)

$(STAMP): pyproject.toml $(PEERS) | $(BIN)/python system-deps
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps HolisticTraceAnalysis==0.5.0  # see pyproject's test extra
	$(if $(PEERS),$(BIN)/pip install -q --no-deps --force-reinstall $(PEERS))
	@touch $(STAMP)

# Debian packages Mooncake's TCP transport needs (skipped where apt is absent or not root).
system-deps:
	@if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  dpkg -s libibverbs1 librdmacm1 libnuma1 liburing2 libcurl4 >/dev/null 2>&1 || \
	  { apt-get update -qq && apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 liburing2 libcurl4 >/dev/null; }; \
	fi

# The main job: GRPO on the arithmetic task (pretrains its base first if missing).
demo: $(STAMP)
	$(BIN)/python -m titan_rl.grpo --config examples/math.yaml

pretrain: $(STAMP)
	$(BIN)/python -m titan_core.pretrain --config examples/pretrain_tiny.yaml

# The suite, after the lint and format checks (what CI runs: .ci/run). Quick local run:
# make test PYTEST_ARGS='-m "not slow"'
test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# ruff at the version pinned in pyproject.toml (the same as .pre-commit-config.yaml's)
lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) runs .pytest_cache
