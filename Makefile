# Two commands for a newcomer: `make demo` and `make test`. Both create .venv and install into it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU wheel for tests/CI and the demo (an unpinned torch may pull a multi-GB CUDA build).
TORCH_PIN ?= torch==2.13.0
DEMO_DIR ?= runs/demo

.PHONY: demo test test-gpu lint bench compile clean wheelhouse install-offline gpu-matrix

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

# Offline GPU machine / air-gapped node: `make wheelhouse` where there is network (wheels in
# .whl/), copy the checkout or just .whl/ over, then `make install-offline` into the interpreter
# that holds torch (a CUDA image's python3). No package index is contacted.
WHEELHOUSE ?= .whl
wheelhouse:
	bash images/offline/wheelhouse.sh $(WHEELHOUSE)

install-offline:
	$(PYTHON) -m pip install -q --no-index --no-deps --no-build-isolation $(WHEELHOUSE)/*.whl
	$(PYTHON) -c "import nvidia_resiliency_ext, kfp_nvrx.components.train_fsdp.trainer; print('kfp-nvrx installed offline')"

# On 1-2 GPUs after install-offline: the GPU acceptance runs and the drill matrix on CUDA.
GPU_OUT ?= runs/gpu
gpu-matrix:
	PATH=$$(dirname $$($(PYTHON) -c 'import sys; print(sys.executable)')):$$PATH bash bench/gpu_matrix.sh $(GPU_OUT)

lint: $(VENV)/.installed-test
	$(PY) -m ruff check .

bench: $(VENV)/.installed-bench
	$(PY) -m bench.run

clean:
	rm -rf $(VENV) runs build *.egg-info
