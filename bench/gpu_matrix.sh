#!/usr/bin/env bash
# The GPU acceptance runs (1-2 GPUs, NCCL, the installed NVRx): healthy runs are never killed by
# their own monitor, in-process restart over NCCL, --nodes 2 on a 2-GPU host, deterministic
# (bitwise) steps and their cost, and the drill matrix on CUDA. Every run's log and result go to
# OUT_DIR; summary.txt has one line per run.
#
#   bash bench/gpu_matrix.sh OUT_DIR [PART ...]     PART: healthy healthyc inproc nodes2 determ drill1 drill2
#
# Needs kfp-nvrx[trainer] installed (see README "Offline install") and 1 or 2 visible GPUs.
set -uo pipefail
OUT_DIR=$(realpath -m "${1:?usage: gpu_matrix.sh OUT_DIR [PART ...]}"); shift
PARTS=${*:-healthy inproc nodes2 determ drill1 drill2}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
KFP=${KFP:-kfp-nvrx}
SUMMARY="$OUT_DIR/summary.txt"
DATA="$OUT_DIR/data"
GPUS=$(nvidia-smi -L | wc -l)

note() { echo "$*" | tee -a "$SUMMARY"; }

versions() {
  python3 - <<'EOF' | tee -a "$SUMMARY"
import platform, subprocess, torch
from importlib.metadata import version
drv = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip().splitlines()
print(f"machine: {platform.node()} {drv}; Python {platform.python_version()}; torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}); "
      f"nvidia-resiliency-ext {version('nvidia-resiliency-ext')}")
EOF
}

# run NAME TIMEOUT -- launch-local args...: one launch-local, its result in one summary line.
run() {
  local name=$1 limit=$2; shift 3
  local t0=$SECONDS
  timeout "$limit" "$KFP" launch-local --json --run-dir "$OUT_DIR/runs/$name" "$@" \
    >"$OUT_DIR/$name.json" 2>"$OUT_DIR/$name.log"
  local rc=$?
  python3 - "$OUT_DIR/$name.json" "$name" "$rc" "$((SECONDS - t0))" <<'EOF' | tee -a "$SUMMARY"
import json, sys
path, name, rc, wall = sys.argv[1:]
text = open(path).read()
try:  # launch-local --json prints the streamed log first, the result object last
    r = json.loads(text[text.rindex("\n{\n") + 1:] if "\n{\n" in text else text)
except ValueError:
    print(f"{name}: rc={rc} no result ({wall}s wall)"); sys.exit()
g = r["summary"]  # the goodput report of the events (every backend)
print(f"{name}: {r['state']} rc={rc} steps={g['steps_final']} restarts={g['restarts']} "
      f"recovery_s={g['recovery_s']} steps_redone={g['steps_redone']} goodput={g['goodput']:.3f} "
      f"final_loss={g.get('final_loss')} wall={wall}s {r['reason'][:200]}")
EOF
}

versions
[ -d "$DATA" ] || "$KFP" prepare-data --source sample: --out "$DATA" --quiet >/dev/null
SMALL=(--config 125m --set data.path="$DATA" --set data.seq_len=512 --set data.batch_size=8)

for part in $PARTS; do
  case $part in
  healthy)  # a 1b run with sub-second steps and no checkpoints: learned timeouts must not kill it
    run healthy-1b 240 -- --config 1b --set data.path="$DATA" --set data.seq_len=1024 \
      --set train.steps=30 --set checkpoint.interval=0 --set checkpoint.save_final=false ;;
  healthyc)  # 1b compiled (slow first steps), saves after the timeouts were learned, final wait
    run healthy-1b-compile 420 -- --config 1b --set data.path="$DATA" --set train.compile=true \
      --set train.steps=45 --set checkpoint.interval=20 --set checkpoint.keep=1 ;;
  inproc)   # in-process restart over NCCL on 2 GPUs (1 node x 2)
    [ "$GPUS" -ge 2 ] || { note "inproc: skipped (needs 2 GPUs)"; continue; }
    run inproc-raise 240 -- --nproc-per-node 2 "${SMALL[@]}" --set train.steps=40 \
      --set checkpoint.interval=10 --set resilience.in_process=true --fault raise@25/1
    grep -h "in-process restart\|term_ex\|fn_ex\|Killed\|SIGKILL\|malloc" "$OUT_DIR/inproc-raise.log" \
      | head -20 >>"$SUMMARY" ;;
  nodes2)   # 2 local nodes x 1 GPU on one 2-GPU host, with an in-job restart
    [ "$GPUS" -ge 2 ] || { note "nodes2: skipped (needs 2 GPUs)"; continue; }
    run nodes2-kill 240 -- --nodes 2 "${SMALL[@]}" --set train.steps=40 \
      --set checkpoint.interval=10 --fault kill@25/1 ;;
  determ)   # what deterministic steps cost: 125m, 1 GPU, no checkpoints, median step time
    for d in false true; do
      run "determ-$d" 240 -- "${SMALL[@]}" --set train.steps=40 --set checkpoint.interval=0 \
        --set train.deterministic=$d
    done
    python3 - "$OUT_DIR" <<'EOF' | tee -a "$SUMMARY"
import json, statistics, sys
def median_step(run):
    ev = [json.loads(l) for l in open(f"{sys.argv[1]}/runs/{run}/events.jsonl")]
    st = [e["end"] - e["start"] for e in ev if e["type"] == "step" and e["step"] > 10]
    return statistics.median(st)
a, b = median_step("determ-false"), median_step("determ-true")
print(f"determ: median step (steps 11-40) {a*1e3:.1f} ms default, {b*1e3:.1f} ms deterministic "
      f"= {b/a:.2f}x")
EOF
    ;;
  drill1)   # the drill matrix on 1 GPU
    timeout 560 "$KFP" drill --device cuda --gpus 1 --out "$OUT_DIR/drill1" >"$OUT_DIR/drill1.log" 2>&1
    note "drill1: rc=$?"; cat "$OUT_DIR/drill1/drill.md" >>"$SUMMARY" 2>/dev/null ;;
  drill2)   # the drill matrix on 2 GPUs (2 local nodes x 1 GPU)
    [ "$GPUS" -ge 2 ] || { note "drill2: skipped (needs 2 GPUs)"; continue; }
    timeout 560 "$KFP" drill --device cuda --gpus 2 --out "$OUT_DIR/drill2" >"$OUT_DIR/drill2.log" 2>&1
    note "drill2: rc=$?"; cat "$OUT_DIR/drill2/drill.md" >>"$SUMMARY" 2>/dev/null ;;
  *) note "unknown part $part" ;;
  esac
done
