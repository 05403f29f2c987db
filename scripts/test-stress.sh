#!/usr/bin/env bash
# The suite on a busy machine (`make test-stress`): HOGS CPU hogs (`yes > /dev/null`, default 2) run
# beside the whole suite, RUNS times in a row (default 1), stopping at the first failure. A test that
# races the clock (a poll that can miss a short state, a deadline sized for a quiet box) fails here;
# tests must wait on the event they mean. The hogs die with the script (trap), however it ends.
set -euo pipefail
PY=${PY:-.venv/bin/python}
HOGS=${HOGS:-2}
RUNS=${RUNS:-1}

hogs=()
stop_hogs() { for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap stop_hogs EXIT
for _ in $(seq "$HOGS"); do
  yes > /dev/null &
  hogs+=("$!")
done

for run in $(seq "$RUNS"); do
  echo "== stress run $run/$RUNS: $HOGS CPU hogs beside the suite on $(nproc) cores =="
  start=$(date +%s)
  CONVEYOR_REQUIRE_KERNELS=1 "$PY" -m pytest -q -x -p no:cacheprovider "$@"
  echo "== stress run $run/$RUNS passed in $(( $(date +%s) - start )) s =="
done
