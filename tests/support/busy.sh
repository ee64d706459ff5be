#!/usr/bin/env bash
# Runs a command while every core is kept busy by a low-priority load
# (make test-load): races that a quiet machine hides show up here first.
# One `nice -n 10` busy loop per core, each ended by `timeout` after
# BUSY_SECONDS at the latest and killed when the command ends, whatever way
# it ends. Exits with the command's status.
set -uo pipefail
seconds=${BUSY_SECONDS:-3600}
cores=$(nproc)
pids=()
stop() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
}
trap stop EXIT
for _ in $(seq 1 "$cores"); do
  nice -n 10 timeout "$seconds" bash -c 'while :; do :; done' &
  pids+=($!)
done
echo "busy.sh: $cores busy loops at nice 10 (at most ${seconds} s) while: $*"
started=$(date +%s)
"$@"
rc=$?
echo "busy.sh: the command exited $rc after $(($(date +%s) - started)) s"
exit $rc
