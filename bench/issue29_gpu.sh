#!/usr/bin/env bash
# The issue-29 GPU runs on one H200: the recovery sweep (bench.recovery_sweep) at 1b and 125m.
# Installs offline from .whl (make wheelhouse), byte-compiles site-packages as the trainer image
# does (once per machine), records versions, then runs the named parts within the command's
# time limit (LIMIT seconds, default 585): a sweep stops starting runs when one would not fit.
#
#   OUT=DIR [SKIP=N] [ONLY=kinds] bash bench/issue29_gpu.sh PART...
#   PART: setup probe sweep1b sweep125m exact tests
set -uo pipefail
OUT=${OUT:?set OUT}
LIMIT=${LIMIT:-585}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
left() { echo $((LIMIT - SECONDS)); }
clean() { rm -rf /dev/shm/kfp-nvrx-* /tmp/kfp-nvrx-bench-*; }
for part in "$@"; do
  t0=$SECONDS
  case $part in
  setup)
    python3 -m pip install -q --no-index --no-deps .whl/nvidia_resiliency_ext-*.whl .whl/defusedxml-*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation . >/dev/null
    purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    [[ -f /tmp/.compiled ]] || { python3 -m compileall -q -j 16 "$purelib" >/dev/null 2>&1; touch /tmp/.compiled; }
    {
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      python3 -c 'import torch, importlib.metadata as m; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())), "nvrx", m.version("nvidia-resiliency-ext"))'
      python3 --version; nproc; free -g | head -2; df -h / /dev/shm | tail -2
      python3 -c 'import sympy, os; print("bytecode cached:", os.path.exists(sympy.__cached__))'
    } > "$OUT/versions.txt" 2>&1
    cat "$OUT/versions.txt" ;;
  sweep1b|sweep125m)
    preset=${part#sweep}
    export PATH=$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):$PATH
    python3 -m bench.recovery_sweep --preset "$preset" --out "$OUT/sweep_${preset}_from${SKIP:-0}.json" \
      --skip-runs "${SKIP:-0}" --budget "$(left)" ${ONLY:+--only "$ONLY"} 2>&1 | grep -v "Warning\|import pynvml" ;;
  probe) python3 -m bench.pin_stall_probe --out "$OUT/pin_stall.json" 2>&1 | grep -v "Warning\|import pynvml" ;;
  exact)  # the drill matrix on CUDA: every fault kind resumes bitwise (train.deterministic)
    export PATH=$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):$PATH
    bash bench/gpu_matrix.sh "$OUT/matrix" drill1 >/dev/null 2>&1; cp "$OUT/matrix/summary.txt" "$OUT/drill1_summary.txt"
    tail -20 "$OUT/drill1_summary.txt"; rm -rf "$OUT/matrix" ;;
  tests) python3 -m pytest -q -ra -p no:cacheprovider tests/gpu 2>&1 | tail -15 ;;
  *) echo "unknown part $part" ;;
  esac
  echo "== $part: rc=$? $((SECONDS - t0))s"
  clean
done
