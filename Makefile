# gym-sessions: `make demo` runs the demo, `make test` runs the tests.
# Needs only Python >= 3.11 (with its venv module) and make.

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3 2>/dev/null)
VENV := .venv
BIN := $(VENV)/bin
# Touched after a successful install; pyproject.toml changing makes it stale.
STAMP := $(VENV)/.installed
# The torch the sb3 extra's tests run with (its CPU build lies on this machine kind's disk).
TORCH_VERSION ?= 2.13.0

export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: venv demo test lint typecheck clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@if [ -z "$(PYTHON)" ]; then echo "make: python3.11 or python3 not found" >&2; exit 1; fi
	@"$(PYTHON)" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
		echo "make: $(PYTHON) is $$("$(PYTHON)" -V 2>&1); gym-sessions needs Python >= 3.11" >&2; \
		exit 1; }
	@if [ ! -x "$(BIN)/python" ]; then \
		echo "creating $(VENV) with $(PYTHON)"; \
		"$(PYTHON)" -m venv "$(VENV)" || { rm -rf "$(VENV)"; exit 1; }; \
	fi
	$(BIN)/python -m pip install --upgrade pip
	@# torch first, pinned: the sb3 extra's bare torch>=2.3 would otherwise let pip
	@# fetch the newest torch, a multi-GB CUDA build; 2.13.0 is the CPU build on disk.
	$(BIN)/python -m pip install "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install -e ".[dev,sb3]"
	@touch "$@"

demo: venv
	$(BIN)/gym-sessions demo

test: venv
	$(BIN)/python -m pytest -q -ra --durations=15

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy

clean:
	rm -rf "$(VENV)" build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
