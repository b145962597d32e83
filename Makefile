# The two commands of the quick start, each doing whatever set-up it needs first (idempotent: the
# set-up reruns only when the lock, a pyproject or the set-up script changed since it last ran).
#
#   make train     the main job: a short real training run on this machine
#   make test      the test suite (what CI runs)
#   make lint      formatter, linter and type checker (CI runs it too)
#
# `uv run --no-sync`: scripts/setup.sh installs the lock; plain `uv run` would re-check vLLM's CPU
# wheel tag and reinstall it on every call.
RUN := uv run --no-sync
CONFIG ?= examples/frozenlake_tiny.yaml
STAMP := .venv/.rollart-setup
SETUP_INPUTS := uv.lock pyproject.toml scripts/setup.sh $(wildcard packages/*/pyproject.toml)

.PHONY: setup train test lint format

setup: $(STAMP)

$(STAMP): $(SETUP_INPUTS)
	bash scripts/setup.sh
	touch $(STAMP)

train: $(STAMP)
	$(RUN) rollart train $(CONFIG) $(ARGS)

test: $(STAMP)
	$(RUN) pytest $(ARGS)

lint: $(STAMP)
	$(RUN) ruff format --check .
	$(RUN) ruff check .
	$(RUN) mypy

format: $(STAMP)
	$(RUN) ruff format .
	$(RUN) ruff check --fix .
