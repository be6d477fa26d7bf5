#!/usr/bin/env bash
# The issue-22 GPU runs on one H200 (recovery at 1b and 125m, the host copy probe), as run for
# docs/benchmarks: install offline, record versions, run the named parts, leave results in OUT.
#
#   OUT=DIR bash bench/issue22_gpu.sh PART...
#   PART: compile probe imports rec1b rec125m tests stall profile healthyc throughput
set -uo pipefail
OUT=${OUT:?set OUT}
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps .whl/nvidia_resiliency_ext-*.whl .whl/defusedxml-*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation . >/dev/null
python3 -c 'import pytest' 2>/dev/null ||
  python3 -m pip install -q --no-index --no-deps .whl/pytest-*.whl .whl/pluggy-*.whl .whl/iniconfig-*.whl
export PATH=$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):$PATH
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, importlib.metadata as m; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())), "nvrx", m.version("nvidia-resiliency-ext"))'
  python3 --version; nproc; free -g | head -2; df -h / /dev/shm | tail -2
  env | grep -i '^PYTHON' || true
  python3 -c 'import sympy, os; print("sympy pyc cached:", os.path.exists(sympy.__cached__))' 
} > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"
clean() { rm -rf /dev/shm/kfp-nvrx-* /tmp/kfp-nvrx-bench-*; df -h / /dev/shm | tail -2; }
for part in "$@"; do
  t0=$SECONDS
  case $part in
  compile)  # this image ships site-packages without bytecode (and PYTHONDONTWRITEBYTECODE=1):
    # every worker start compiles torch and sympy from source. pip installs compile by default.
    python3 -m compileall -q -j 16 "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1
    python3 -c 'import sympy, os; print("sympy pyc cached:", os.path.exists(sympy.__cached__))' ;;
  probe) python3 -m bench.hostcopy_probe --out "$OUT/hostcopy_probe.json" > /dev/null ;;
  imports)
    python3 -X importtime -c "import kfp_nvrx.components.training.trainer.train" 2>"$OUT/logs/importtime.txt"
    sort -t'|' -k2 -n "$OUT/logs/importtime.txt" | tail -25 ;;
  rec1b) python3 -m bench.recovery --preset 1b --out "$OUT/recovery_1b.json" --keep-logs "$OUT/logs" \
           --run-timeout 150 ${ONLY1B:+--only $ONLY1B} ;;
  rec125m) python3 -m bench.recovery --preset 125m --out "$OUT/recovery.json" --keep-logs "$OUT/logs" \
           --run-timeout 120 ;;
  tests) python3 -m pytest -q -ra -p no:cacheprovider tests/gpu 2>&1 | tail -15 ;;
  stall)  # the shipped overlap and blocking saves with the per-step split, and the cold load
    python3 -m bench.ckpt_stall --config 1b --saves ${SAVES:-4} --modes overlap,blocking \
      --skip "${STALL_SKIP-torch_save,dcp_save,dcp_async,stager}" --profile-save --out "$OUT/ckpt_stall.json" ;;
  profile) python3 -m bench.step_profile --config 1b --out "$OUT/step_profile.json" \
             ${VARIANTS:+--variants "$VARIANTS"} ;;
  healthyc)  # 1b, train.compile=true, learned timeouts at the 4 s floor, saves: never killed
    bash bench/gpu_matrix.sh "$OUT/matrix" healthyc; cp "$OUT/matrix/summary.txt" "$OUT/logs/matrix.txt"
    grep -h "learned NVRx timeouts\|Did not get\|has been open" "$OUT"/matrix/*.log | head -5
    rm -rf "$OUT/matrix/runs" "$OUT/matrix/data" ;;
  throughput) python3 -m bench.throughput --out "$OUT/throughput.json" ${TP_ONLY:+--only "$TP_ONLY"} ;;
  *) echo "unknown part $part" ;;
  esac
  echo "== $part: rc=$? $((SECONDS - t0))s"
  clean
  tar -C "$OUT" -czf "$OUT/logs.tgz" logs  # after every part: a run cut short keeps its logs
done
rm -rf "$OUT/logs"
