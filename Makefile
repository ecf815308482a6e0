# kubellm: `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# The torch the project is tested with, installed before kubellm: an unpinned torch pulls
# a multi-GB CUDA build. torch==2.13.0 from PyPI is that CUDA build too; it is the CPU
# build only where a local wheel shadows the index (pip's find-links on the development
# machine). TORCH_INDEX picks where it comes from: empty, pip's configured indexes; elsewhere
# `make install TORCH_INDEX=https://download.pytorch.org/whl/cpu` takes PyTorch's CPU wheel.
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX ?=
# The extras `make install` installs (pyproject.toml; README, "Two commands"): dev is all of
# them plus the test tools `make test` needs.
EXTRAS ?= dev
# The stamp names the extras: another EXTRAS installs again.
STAMP := $(VENV)/.installed-$(EXTRAS)
ARGS ?=
# `make test` runs the suite as two pytest processes side by side (tests/lanes.py; the time
# budget is in DEVELOPERS.md); `make test LANES=0` runs it as one. Either way bytecode is
# written (an environment's PYTHONDONTWRITEBYTECODE is dropped for the suite): its hundreds
# of interpreters then compile kubellm's modules once instead of each on its own.
LANES ?= 1
TEST_ENV := env -u PYTHONDONTWRITEBYTECODE
# checkov (tests/manifests runs it on every kustomization) pins old versions of packages
# the project shares, so it gets a venv of its own. The stamp names the version: changing
# CHECKOV_VERSION reinstalls, an unchanged one does nothing.
CHECKOV_VERSION ?= 3.3.30
CHECKOV_VENV ?= .venv-checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed-$(CHECKOV_VERSION)
# Images: make images REGISTRY=ghcr.io/kubellm TAG=0.1.0 (docker, BuildKit).
DOCKER ?= docker
REGISTRY ?= ghcr.io/kubellm
TAG ?= 0.1.0
IMAGES := runtime serving trainer
# The images install the torch the venv is tested with (TORCH_PIN above).
TORCH_VERSION := $(patsubst torch==%,%,$(TORCH_PIN))

.DEFAULT_GOAL := help

.PHONY: help
help: ## Show this help
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)" -e ".[$(EXTRAS)]"
	@touch $(STAMP)

.PHONY: install
install: $(STAMP) ## Create .venv with kubellm[EXTRAS] (default dev: all extras + test tools); TORCH_INDEX=URL

.PHONY: run
run: $(STAMP) ## Run the whole pipeline locally (compiled YAML, kfp.local); ARGS="--set k=v"
	$(BIN)/kubellm run --local $(ARGS)

$(CHECKOV_STAMP):
	@test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install --quiet "checkov==$(CHECKOV_VERSION)"
	@rm -f $(CHECKOV_VENV)/.installed-*
	@touch $@

.PHONY: checkov
checkov: $(CHECKOV_STAMP) ## Create .venv-checkov with checkov (pinned; its own venv)

# tests/slurm starts a real Slurm (munged, slurmctld, slurmd on localhost): Debian's packages.
SLURM_PACKAGES := slurmctld slurmd slurm-client munge
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: slurm-deps
slurm-deps: ## Install Slurm and munge for tests/slurm (Debian/Ubuntu apt; sudo unless root)
	@command -v slurmctld >/dev/null || test -x /usr/sbin/slurmctld || { \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(SLURM_PACKAGES); }

.PHONY: test
test: $(STAMP) $(CHECKOV_STAMP) ## Run the full test suite (what CI runs), in two lanes
ifeq ($(LANES),0)
	$(TEST_ENV) $(BIN)/python -m pytest $(ARGS)
else
	$(TEST_ENV) $(BIN)/python tests/lanes.py $(ARGS)
endif

.PHONY: lint
lint: $(STAMP) ## ruff lint + format check, mypy on src, import layering (lint-imports)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

.PHONY: format
format: $(STAMP) ## Apply ruff fixes and formatting
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

.PHONY: compile
compile: $(STAMP) ## Recompile pipelines/*.yaml from pipelines/*.py
	$(BIN)/kubellm compile

.PHONY: bench
bench: bench-prepare bench-train bench-startup bench-serve ## All benchmarks -> docs/benchmarks-*.md; ARGS (e.g. --check) go to each

.PHONY: bench-prepare
bench-prepare: $(STAMP) ## prepare_data vs the fastest tokenizer call and datasets.map, clean and messy corpora; memory 10x vs 1x
	$(BIN)/python -m bench.prepare_bench --size-mb 20 --scale 10 --repeats 3 --out docs/benchmarks-prepare.md $(ARGS)

.PHONY: bench-serve
bench-serve: $(STAMP) ## Model server p50/p99 vs its engine in-process, batched vs sequential req/s, locust load test
	$(BIN)/python -m bench.serve_bench --out docs/benchmarks-serve.md $(ARGS)

.PHONY: bench-startup
bench-startup: $(STAMP) ## FSDP2 start-up host memory of a ~1B model (2 CPU ranks) vs every rank from_pretrained
	$(BIN)/python -m bench.startup_bench --out docs/benchmarks-startup.md $(ARGS)

.PHONY: bench-train
bench-train: $(STAMP) ## Training tokens/s: kubellm.train vs HF Trainer and a minimal DDP loop
	$(BIN)/python -m bench.train_bench --repeats 3 --out docs/benchmarks-train.md $(ARGS)

.PHONY: gpu-check
gpu-check: $(STAMP) ## GPU check (venv): versions + matmul, DDP/FSDP2 + exact resume + export, LoRA+compile, d12 MFU, NCCL
	$(BIN)/python bench/gpu_check.py --out runs/gpu-check $(ARGS)

# The wheels the training path imports at module level that the borrowed GPU machine's image
# lacks (kubellm.config: pydantic; kubellm.data.sources: zstandard), pinned as in the venv,
# for its python3.12 on x86-64. They are unzipped (all an install of a wheel needs for
# import), not pip-installed: pip --target does not install across Python versions. The
# device command: PYTHONPATH=src:$(GPU_BUNDLE)/site python3 bench/gpu_check.py --out $$OUT,
# with $(GPU_BUNDLE) in the device tool's carry list (64 MiB per run, working tree included).
# zstandard's cffi backend (12 MiB) goes: on CPython it imports its C backend.
GPU_BUNDLE ?= .gpu-bundle
GPU_BUNDLE_WHEELS ?= pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
	typing-inspection==0.4.5 zstandard==0.25.0
GPU_BUNDLE_PYTHON ?= python3

.PHONY: gpu-bundle
gpu-bundle: ## Wheels the GPU image lacks (pydantic, zstandard) unzipped into .gpu-bundle/site; fails at >= 64 MiB
	@set -euo pipefail; rm -rf $(GPU_BUNDLE); mkdir -p $(GPU_BUNDLE)/wheels $(GPU_BUNDLE)/site; \
	$(GPU_BUNDLE_PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d $(GPU_BUNDLE)/wheels $(GPU_BUNDLE_WHEELS); \
	for w in $(GPU_BUNDLE)/wheels/*.whl; do $(GPU_BUNDLE_PYTHON) -m zipfile -e "$$w" $(GPU_BUNDLE)/site; done; \
	rm -rf $(GPU_BUNDLE)/wheels $(GPU_BUNDLE)/site/zstandard/_cffi.*.so; \
	$(GPU_BUNDLE_PYTHON) -c 'import os, subprocess, sys; \
	size = lambda paths: sum(os.path.getsize(p) for p in paths if os.path.isfile(p)); \
	site = [os.path.join(d, f) for d, _, fs in os.walk(sys.argv[1]) for f in fs]; \
	tree = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True, text=True).stdout.split("\0"); \
	b, t, limit = size(site), size(tree), 64 << 20; \
	print(f"gpu-bundle: {sys.argv[1]} {b / 2**20:.1f} MiB ({len(site)} files); with the working tree ({t / 2**20:.1f} MiB) {(b + t) / 2**20:.1f} MiB of the 64 MiB a device run carries"); \
	sys.exit(f"gpu-bundle: too big (>= 64 MiB)") if b >= limit or b + t >= limit else None' $(GPU_BUNDLE)/site

CRDS_DIR := tests/fixtures/crds

.PHONY: update-crds
update-crds: ## Re-fetch the vendored CRD schemas (tests/fixtures/crds) at the commits in its README
	@set -euo pipefail; \
	rows=$$(awk -F'|' '$$2 ~ /\.(yaml|json) *$$/ { for (i = 2; i <= 6; i++) gsub(/[ `]/, "", $$i); print $$2, $$3, $$4, $$5 }' $(CRDS_DIR)/README.md); \
	test -n "$$rows" || { echo "no files listed in $(CRDS_DIR)/README.md" >&2; exit 1; }; \
	while read -r file repo path commit; do \
	  url="https://raw.githubusercontent.com/$$repo/$$commit/$$path"; \
	  echo "$$file <- $$url"; \
	  curl -fsSL --retry 3 --connect-timeout 20 -o "$(CRDS_DIR)/$$file.part" "$$url" \
	    || { rm -f "$(CRDS_DIR)/$$file.part"; exit 1; }; \
	  mv "$(CRDS_DIR)/$$file.part" "$(CRDS_DIR)/$$file"; \
	done <<< "$$rows"; \
	cd $(CRDS_DIR) && echo "sha256 (the README's last column):" && sha256sum $$(awk '{print $$1}' <<< "$$rows")

.PHONY: mlflow-ui
mlflow-ui: $(STAMP) ## Open the MLflow UI on the local results (127.0.0.1:5000)
	$(BIN)/mlflow ui --backend-store-uri sqlite:///runs/mlflow.db --host 127.0.0.1 --port 5000

.PHONY: manifests
manifests: ## Render the kustomize overlays (needs kubectl)
	kubectl kustomize manifests/base >/dev/null && echo "base ok"
	kubectl kustomize manifests/overlays/rdma >/dev/null && echo "rdma ok"
	kubectl kustomize manifests/overlays/single-node >/dev/null && echo "single-node ok"

.PHONY: render
render: $(STAMP) ## Print the Kubernetes objects a cluster run creates; ARGS="--set k=v"
	$(BIN)/kubellm render $(ARGS)

.PHONY: images
images: $(addprefix image-,$(IMAGES)) ## Build the images (docker): make images REGISTRY=ghcr.io/kubellm TAG=0.1.0

.PHONY: images-push
images-push: $(addprefix push-,$(IMAGES)) ## Build and push the images (same REGISTRY and TAG as images)

# One target of containers/Dockerfile per image, built from the repository root.
.PHONY: $(addprefix image-,$(IMAGES))
$(addprefix image-,$(IMAGES)): image-%:
	$(DOCKER) build -f containers/Dockerfile --target $* --build-arg TORCH_VERSION=$(TORCH_VERSION) -t $(REGISTRY)/$*:$(TAG) .

.PHONY: $(addprefix push-,$(IMAGES))
$(addprefix push-,$(IMAGES)): push-%: image-%
	$(DOCKER) push $(REGISTRY)/$*:$(TAG)

.PHONY: clean
clean: ## Remove local run state (runs/, kfp outputs); keeps .venv
	rm -rf runs local_outputs

.PHONY: distclean
distclean: clean ## Remove everything made here, .venv included
	rm -rf $(VENV) .venv-checkov .mypy_cache .pytest_cache .ruff_cache
