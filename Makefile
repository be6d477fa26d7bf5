# Two commands for a newcomer: `make demo` and `make test`. Both create .venv and install into it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU wheel for tests/CI and the demo (an unpinned torch may pull a multi-GB CUDA build).
TORCH_PIN ?= torch==2.13.0
DEMO_DIR ?= runs/demo

.PHONY: demo test test-gpu lint typecheck bench compile clean wheelhouse install-offline \
        gpu-matrix cluster-bins cluster-up cluster-down

$(VENV)/.installed-%: setup.cfg setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_PIN)"
	# setuptools warns on every editable install of a package_dir mapping (the folders are not
	# named kfp_nvrx); nothing to act on, so a newcomer's screen stays clean.
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -e ".[$*]"
	touch $@

demo: $(VENV)/.installed-all
	$(VENV)/bin/kfp-nvrx run-local --pipeline fsdp-train --out $(DEMO_DIR) --param faults=kill@20/1

# The cluster tests (tests/cluster) need the control-plane binaries: built here when Go is on PATH
# (cached outside the checkout, see cluster-bins); without Go they are skipped with one line.
# TEST_WORKERS pytest-xdist workers: the cluster tests spend most of their time waiting on the
# controllers, so a second worker runs the rest meanwhile. A module runs on one worker, and all of
# tests/cluster on one (one session cluster; tests/conftest.py), started first as it is collected
# first (no reordering). TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2
test: $(VENV)/.installed-test
	$(PY) -m ruff check .
	$(MAKE) --no-print-directory typecheck
	@if command -v go >/dev/null; then $(MAKE) --no-print-directory cluster-bins; \
	else echo "make test: no Go on PATH; the cluster tests will be skipped (make cluster-bins)"; fi
	$(PY) -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# A real control plane from Go modules (kube-apiserver, etcd, kube-controller-manager,
# kube-scheduler, Kubeflow Trainer, JobSet, Training Operator), built once into
# ~/.cache/kfp-nvrx/cluster-bins/<versions key>/ (KFP_NVRX_CLUSTER_CACHE to move it).
cluster-bins:
	bash tests/harness/build.sh >/dev/null

# Start / stop a test cluster on 127.0.0.1 (CLUSTER_NODES test nodes, default 2) in
# CLUSTER_DIR (default /tmp/kfp-nvrx-cluster-$UID); `up` prints the kubeconfig path.
CLUSTER_NODES ?= 2
CLUSTER_DIR ?= /tmp/kfp-nvrx-cluster-$(shell id -u)
cluster-up: $(VENV)/.installed-test cluster-bins
	cd tests && ../$(PY) -m harness up --dir $(CLUSTER_DIR) --nodes $(CLUSTER_NODES)

cluster-down: $(VENV)/.installed-test
	cd tests && ../$(PY) -m harness down --dir $(CLUSTER_DIR)

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
	$(PYTHON) -c "import nvidia_resiliency_ext, kfp_nvrx.components.training.trainer; print('kfp-nvrx installed offline')"

# On 1-2 GPUs after install-offline: the GPU acceptance runs and the drill matrix on CUDA.
GPU_OUT ?= runs/gpu
gpu-matrix:
	PATH=$$(dirname $$($(PYTHON) -c 'import sys; print(sys.executable)')):$$PATH bash bench/gpu_matrix.sh $(GPU_OUT)

lint: $(VENV)/.installed-test
	$(PY) -m ruff check .

# mypy over the library (config: [mypy] in setup.cfg). It finds modules by folder, and the import
# name kfp_nvrx.components maps onto components/ (package_dir), so it reads them through links
# that carry the import names, in build/typecheck/.
TYPECHECK_DIR := build/typecheck
typecheck: $(VENV)/.installed-test
	@mkdir -p $(TYPECHECK_DIR)/kfp_nvrx
	@ln -sfn $(CURDIR)/components $(TYPECHECK_DIR)/kfp_nvrx/components
	@ln -sfn $(CURDIR)/pipelines $(TYPECHECK_DIR)/kfp_nvrx/pipelines
	cd $(TYPECHECK_DIR) && $(CURDIR)/$(PY) -m mypy --config-file $(CURDIR)/setup.cfg \
	    -p kfp_nvrx.components -p kfp_nvrx.pipelines

bench: $(VENV)/.installed-bench
	$(PY) -m bench.run

# The compiled pipelines committed in pipelines/compiled/ (tests/integration/test_pipelines.py
# fails when they are stale). KFP_NVRX_REGISTRY names the component images' registry.
compile: $(VENV)/.installed-all
	$(VENV)/bin/kfp-nvrx compile --out pipelines/compiled

clean:
	rm -rf $(VENV) runs build *.egg-info
