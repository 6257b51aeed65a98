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

.PHONY: venv demo test test-slow lint typecheck docs uvicorn-latest clean image base-image redis-image

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
	$(BIN)/python -m pip install -e ".[dev,sb3,trl,docs,atari]"
	@touch "$@"

demo: venv
	$(BIN)/gym-sessions demo

# The default run skips tests marked slow (minutes each: GRPO training, 50 supervisor
# kills, ...); `make test-slow` runs just those, and .ci/run runs both.
test: venv
	$(BIN)/python -m pytest -q -ra --durations=15 -m "not slow" -n auto --dist loadgroup

test-slow: venv
	$(BIN)/python -m pytest -q -ra --durations=15 -m slow -n auto --dist loadgroup

# lint-imports: the layering rules of docs/design.md §2 (contracts in pyproject.toml).
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-logo
	$(BIN)/vulture
	$(MAKE) docs

# The docs site (mkdocs.yml): --strict fails on a broken link or anchor, a page left out
# of the nav, or a docstring that does not render.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

typecheck: venv
	$(BIN)/mypy

# gym_sessions/transport rests on uvicorn's internals, gated to TESTED_UVICORN: its
# tests on the newest uvicorn, in a second venv (.ci/uvicorn-latest says what it shows).
UVICORN_VENV ?= build/uvicorn-latest
uvicorn-latest: venv
	VENV=$(VENV) UVICORN_VENV=$(UVICORN_VENV) .ci/uvicorn-latest

clean:
	rm -rf "$(VENV)" build dist site *.egg-info .pytest_cache .ruff_cache .hypothesis .import_linter_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# Container image (docs/deployment.md). The base is built from Debian packages
# (no registry needed) and kept in podman's store between runs; IMAGE_BASE=...
# builds on another base, e.g. docker.io/library/python:3.11-slim.
export CONTAINERS_CONF ?= $(CURDIR)/deploy/podman/containers.conf
IMAGE ?= localhost/gym-sessions:dev
BASE_IMAGE := localhost/gym-sessions-base:bookworm
# Redis for `podman kube play` of deploy/kubernetes where no registry is reachable.
REDIS_IMAGE := localhost/gym-sessions-redis:bookworm
IMAGE_BASE ?= $(BASE_IMAGE)
CA_BUNDLE ?= /etc/ssl/certs/ca-certificates.crt

base-image:
	@if ! podman image exists $(BASE_IMAGE); then \
		set -e; tmp=$$(mktemp -d); \
		mmdebstrap --variant=minbase --include=python3,python3-venv bookworm "$$tmp/base.tar"; \
		podman import "$$tmp/base.tar" $(BASE_IMAGE); rm -rf "$$tmp"; \
	fi

image: venv $(if $(filter $(BASE_IMAGE),$(IMAGE_BASE)),base-image)
	rm -rf build/image && mkdir -p build/image/dist
	@# A wheel of unchanged sources is byte for byte the same (timestamps from the last
	@# commit), so podman reuses its cached layers instead of installing it again.
	SOURCE_DATE_EPOCH=$$(git log -1 --format=%ct 2>/dev/null || echo 315532800) \
		$(BIN)/python -m pip wheel --no-deps --no-build-isolation -q -w build/image/dist .
	podman build --format docker --network=host \
		$(if $(wildcard $(CA_BUNDLE)),--volume $(dir $(CA_BUNDLE)):$(dir $(CA_BUNDLE)):ro --build-arg PIP_CERT=$(CA_BUNDLE)) \
		--build-arg BASE=$(IMAGE_BASE) -f deploy/Containerfile -t $(IMAGE) build/image

redis-image: base-image
	podman build --network=host --build-arg BASE=$(BASE_IMAGE) \
		-f deploy/podman/Containerfile.redis -t $(REDIS_IMAGE) deploy/podman
