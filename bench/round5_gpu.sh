#!/usr/bin/env bash
# The round-5 GPU runs on one H200 in one batch: install offline (bench/gpu_setup.sh), the GPU
# tests, the snapshot benchmark at 1b (bench.snapshots), the start-up hang runs and the peer
# copies (bench.peer_transfer, bench.replica_cost). Each part writes its own files under OUT, so
# a batch cut short keeps what it finished.
#
#   OUT=DIR [BUDGET=seconds] bash bench/round5_gpu.sh PART...
#   PART: setup tests pinprobe snapshots hangs peers replica recovery sweep sweep:PRESET[:I,J] exact
#   (SNAP_RUNS, RECOVERY_ONLY, RECOVERY_SET, RECOVERY_COLD=0, SWEEP_ONLY, SWEEP_SET, SWEEP_PRESET,
#   PEER_GB pick what a part runs; SWEEP_RUNS[_<preset>]: the first N runs of a sweep's plan;
#   sweep:125m is a sweep of that preset, sweep:1b:6,3 those runs of its plan; exact is the
#   bitwise resume of every fault kind at 125m on CUDA (kfp-nvrx drill --config 125m,
#   EXACT_SCENARIOS); *_SET is one key=value override for every run of the part;
#   SNAP_RUNS=defaults,defaults+warm is the A/B of warm worker starts; TESTS_GATE=0 runs the
#   later parts after failed GPU tests)
# A lease's commands last 10 minutes at most: start it detached and collect OUT from later calls
#   (bench/lease_round5.sh does that from a copy of the tree)
#   setsid nohup env OUT=/tmp/r5 bash bench/round5_gpu.sh setup tests snapshots >/tmp/r5.log 2>&1 &
set -uo pipefail
OUT=${OUT:?set OUT}
BUDGET=${BUDGET:-1200}
mkdir -p "$OUT"
source bench/gpu_setup.sh
# Seconds left: to the epoch in /tmp/r5.deadline when a later call wrote one (the device time the
# lease reported left, known only once the machine has started), else BUDGET from the start.
left() {
  if [[ -s /tmp/r5.deadline ]]; then echo $(($(cat /tmp/r5.deadline) - $(date +%s)))
  else echo $((BUDGET - SECONDS)); fi
}
# A sweep's run count: SWEEP_RUNS_<preset> (e.g. SWEEP_RUNS_125m), else SWEEP_RUNS, else all.
runs_of() { local v="SWEEP_RUNS_$1"; echo "${!v:-${SWEEP_RUNS:-0}}"; }
for part in "$@"; do
  t0=$SECONDS
  case $part in
  setup) gpu_setup ;;
  tests) python3 -m pytest -q -ra -rP -p no:cacheprovider tests/gpu > "$OUT/gpu_tests.log" 2>&1
    rc=$?; tail -15 "$OUT/gpu_tests.log"
    [[ $rc == 0 || ${TESTS_GATE:-1} == 0 ]] || { echo "== tests failed: the benchmarks are not run"; exit 1; } ;;
  snapshots) python3 -m bench.snapshots --preset 1b --out "$OUT/snapshots_1b.json" \
      --only "${SNAP_RUNS:-off,defaults,2,5,30,kills}" --budget "$(left)" 2>&1 |
      grep -v "Warning\|import pynvml" ;;
  pinprobe) python3 -m bench.pin_stall_probe --out "$OUT/pin_stall.json" 2>&1 |
      grep -v "Warning\|import pynvml" ;;
  peers) python3 -m bench.peer_transfer --gb "${PEER_GB:-13.25}" --repeat 3 \
      --out "$OUT/peer_restore.json" 2>&1 | grep -v "Warning\|import pynvml" ;;
  replica) python3 -m bench.replica_cost --preset 1b --gb "${PEER_GB:-13.25}" --rounds 3 \
      --out "$OUT/peer_round_cost.json" 2>&1 | grep -v "Warning\|import pynvml" ;;
  hangs) python3 -m bench.startup_hangs --preset 1b --out "$OUT/startup_hangs_1b.json" \
      --budget "$(left)" 2>&1 | grep -v "Warning\|import pynvml" ;;
  recovery) python3 -m bench.recovery --preset 1b --only "${RECOVERY_ONLY:-kill,raise-twice,raise-nvrx}" \
      ${RECOVERY_SET:+--set "$RECOVERY_SET"} --out "$OUT/recovery_1b.json" --keep-logs "$OUT/recovery_logs" 2>&1 | grep -v "Warning\|import pynvml"
    [[ ${RECOVERY_COLD:-1} == 0 ]] ||
    python3 -m bench.recovery --preset 1b --only kill --set resilience.warm_start=false \
      --out "$OUT/recovery_1b_cold.json" 2>&1 | grep -v "Warning\|import pynvml" ;;
  sweep|sweep:*) IFS=: read -r _ preset pick <<< "$part"; preset=${preset:-${SWEEP_PRESET:-1b}}
    python3 -m bench.recovery_sweep --preset "$preset" --budget "$(left)" \
      ${SWEEP_ONLY:+--only "$SWEEP_ONLY"} ${SWEEP_SET:+--set "$SWEEP_SET"} --max-runs "$(runs_of "$preset")" \
      --pick "${pick:-}" --out "$OUT/recovery_sweep_$preset${pick:+_${pick//,/-}}.json" 2>&1 | grep -v "Warning\|import pynvml" ;;
  exact) scen=(); for s in ${EXACT_SCENARIOS:-kill-rank hang-rank raise-in-process kill-in-ckpt}; do scen+=(--scenario "$s"); done
    timeout "$(left)" kfp-nvrx drill --device cuda --gpus 1 --config 125m "${scen[@]}" \
      --out "$OUT/drill_125m" > "$OUT/drill_125m.log" 2>&1
    echo "drill rc=$?"; tail -12 "$OUT/drill_125m.log"
    # the run dirs hold 1.5 GB checkpoints, four kept per run: the reports and logs come back
    rm -rf "$OUT/drill_125m/runs" "$OUT/drill_125m/data" ;;
  *) echo "unknown part $part" ;;
  esac
  echo "== $part: rc=$? $((SECONDS - t0))s"
  gpu_clean
done
echo "== done"
