#!/usr/bin/env bash
# `make test`: setup, the whole suite with the native kernels required, then every other kernel level
# (scripts/kernel-levels.sh), and a table of each stage's time at the end, passed or not.
# While the main pytest run goes (one Python process, often on one core), `kernel-levels.sh --prepare`
# builds the other levels' kernels and runs the compile-only checks beside it under nice (it takes only
# what pytest leaves idle), into their caches; the levels' tests then start beside what it has left.
# Arguments go to the main pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PY:-$VENV/bin/python}
MAKE=${MAKE:-make}
STAGES=$(mktemp)
PREPARE_LOG=$(mktemp)
export STAGES
started=$SECONDS
prepare_pid=

summary() {
  local rc=$?
  if [ -n "$prepare_pid" ]; then kill -- "-$prepare_pid" 2>/dev/null || true; fi  # its whole process group
  echo
  echo "== make test: stage times ($(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)) =="
  printf '%-36s %8s  %s\n' stage seconds status
  while IFS=$'\t' read -r name seconds status; do
    printf '%-36s %8s  %s\n' "$name" "$seconds" "$status"
  done < "$STAGES"
  printf '%-36s %8s  %s\n' "total (wall)" $((SECONDS - started)) "$([ $rc = 0 ] && echo passed || echo "FAILED (exit $rc)")"
  rm -f "$STAGES" "$PREPARE_LOG"
}
trap summary EXIT

stage() {  # name, command...: run and time it; the first failure ends `make test`
  local name=$1 start=$SECONDS status=ok
  shift
  echo "== $name =="
  "$@" || status=FAILED
  printf '%s\t%s\t%s\n' "$name" $((SECONDS - start)) "$status" >> "$STAGES"
  [ "$status" = ok ]
}

stage setup "$MAKE" --no-print-directory setup VENV="$VENV"

# setsid: its own process group, so that a failed run ends it, compilers and all
PY=$PY setsid nice -n 10 scripts/kernel-levels.sh --prepare > "$PREPARE_LOG" 2>&1 &
prepare_pid=$!

stage pytest env CONVEYOR_REQUIRE_KERNELS=1 "$PY" -m pytest -q -x "$@"

# The levels' tests start now, beside whatever --prepare has left (it finishes its compile checks).
PY=$PY PREPARE_PID=$prepare_pid scripts/kernel-levels.sh
wait "$prepare_pid" || true
prepare_pid=
sed 's/^/   prepare: /' "$PREPARE_LOG" | grep -v ': cached$' || true
