# Two commands for a newcomer: `make demo` and `make test`. Both create .venv and install into it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU wheel for tests/CI and the demo (an unpinned torch may pull a multi-GB CUDA build).
TORCH_PIN ?= torch==2.13.0
DEMO_DIR ?= runs/demo

.PHONY: demo test test-gpu lint bench compile clean

$(VENV)/.installed-%: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[$*]"
	touch $@

demo: $(VENV)/.installed-all
	$(VENV)/bin/kfp-nvrx run-local --pipeline fsdp-train --out $(DEMO_DIR) --param faults=kill@20/1

test: $(VENV)/.installed-test
	$(PY) -m ruff check .
	$(PY) -m pytest -q -ra --durations=15

# On a CUDA machine: the GPU tests (pinned staging, overlapped D2H, in-memory restore).
test-gpu: $(VENV)/.installed-test
	$(PY) -m pytest -q -ra tests/gpu

lint: $(VENV)/.installed-test
	$(PY) -m ruff check .

bench: $(VENV)/.installed-bench
	$(PY) -m bench.run

clean:
	rm -rf $(VENV) runs build *.egg-info
