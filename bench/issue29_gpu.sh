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
source bench/gpu_setup.sh
left() { echo $((LIMIT - SECONDS)); }
clean() { gpu_clean; }
for part in "$@"; do
  t0=$SECONDS
  case $part in
  setup) gpu_setup ;;
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
