#!/usr/bin/env bash
# Drives bench/round5_gpu.sh through the device tool's calls (10 minutes each at most): `start`
# copies this checkout to /tmp/w and starts the batch there detached, so the fresh copy of the
# tree a later call brings cannot change the script under it; `start` and `wait` then wait up
# to WAIT seconds for the batch and copy what it wrote so far (/tmp/r5) into the call's $OUT.
#
#   bash bench/lease_round5.sh start PART...   (environment: round5_gpu.sh's, e.g. BUDGET)
#   [LEFT_S=seconds] bash bench/lease_round5.sh wait   (LEFT_S: the device time the lease has
#   left, as its last reply said; the batch's parts then budget against it)
set -uo pipefail
what=${1:?start PART... | wait}; shift
if [[ $what == start ]]; then
  rm -rf /tmp/w /tmp/r5 /tmp/r5.deadline && mkdir -p /tmp/w && cp -a . /tmp/w/
  (cd /tmp/w && setsid nohup env OUT=/tmp/r5 bash bench/round5_gpu.sh "$@" >/tmp/r5.log 2>&1 </dev/null &)
fi
[[ -n ${LEFT_S:-} ]] && echo $(($(date +%s) + LEFT_S)) > /tmp/r5.deadline
for ((i = 0; i < ${WAIT:-540}; i += 5)); do
  grep -q "^== done" /tmp/r5.log 2>/dev/null && break
  sleep 5
done
tail -n "${TAIL:-25}" /tmp/r5.log
mkdir -p "${OUT:?}/r5" && cp -a /tmp/r5/. "$OUT/r5/" 2>/dev/null; cp /tmp/r5.log "$OUT/"
