# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build where no NVIDIA driver is present; the default (CUDA) build otherwise.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch>=2.6" || echo "torch==2.13.0")
DEMO_DIR ?= splitflow-demo
# Test processes: two keep a 2-core CI machine busy while tests wait on servers and subprocesses
# (each test module runs whole in one of them); 0 runs the suite in this process.
TEST_WORKERS ?= 2
export HF_HUB_OFFLINE ?= 1
export DO_NOT_TRACK ?= 1

.PHONY: setup demo test clean-demo

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "splitflow needs Python >= 3.11"'
	$(PYTHON) -m venv $(VENV)
	echo "$(TORCH_SPEC)" > $(VENV)/constraints.txt
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install -q --disable-pip-version-check -c $(VENV)/constraints.txt -e ".[test]"
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/splitflow demo --workdir $(DEMO_DIR)

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope

clean-demo:
	rm -rf $(DEMO_DIR)
