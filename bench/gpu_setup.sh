# Sourced by the bench/*_gpu.sh scripts on the offline GPU machine: installs NVRx 0.7 and this
# checkout from .whl (made by `make wheelhouse` where there is network), byte-compiles
# site-packages once per machine (as the trainer image does; the CUDA image ships none), keeps
# NVLink multicast off and writes the versions the results are recorded with to $OUT/versions.txt.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpu_setup() {
  python3 -m pip install -q --no-index --no-deps .whl/nvidia_resiliency_ext-*.whl .whl/defusedxml-*.whl \
    .whl/crc32c-*.whl
  python3 -m pip install -q --no-index --no-deps --no-build-isolation . >/dev/null
  python3 -c 'import pytest' 2>/dev/null ||
    python3 -m pip install -q --no-index --no-deps .whl/pytest-*.whl .whl/pluggy-*.whl .whl/iniconfig-*.whl
  local purelib
  purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  [[ -f /tmp/.compiled ]] || { python3 -m compileall -q -j 16 "$purelib" >/dev/null 2>&1; touch /tmp/.compiled; }
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c 'import torch, importlib.metadata as m; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())), "nvrx", m.version("nvidia-resiliency-ext"))'
    python3 --version; nproc; free -g | head -2; df -h / /dev/shm | tail -2
    python3 -c 'import sympy, os; print("bytecode cached:", os.path.exists(sympy.__cached__))'
    echo "tree of commit ${LEASE_COMMIT:-unknown (set LEASE_COMMIT)}"
  } > "$OUT/versions.txt" 2>&1
  cat "$OUT/versions.txt"
}
# ft_launcher and kfp-nvrx sit beside the python3 that holds torch.
export PATH=$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):$PATH
# Between runs: a 1b checkpoint is 13 GB and that disk is 64 GB; host copies live in /dev/shm.
gpu_clean() { rm -rf /dev/shm/kfp-nvrx-* /tmp/kfp-nvrx-bench-*; }
