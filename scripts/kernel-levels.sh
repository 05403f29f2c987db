#!/usr/bin/env bash
# The C++ kernels at every ISA level this one machine can reach (part of `make test`):
#   - built and tested for real: x86-64-v3 (AVX2+FMA, with torch and oneDNN capped at AVX2 too, as on
#     an AVX2 laptop) and x86-64 (baseline, the portable path), plus skylake-avx512 (AVX-512 without
#     BF16) where this CPU runs it: the kernel, invariance and speculation tests, kernels required.
#     A level whose kernel build is native's (every predefined macro the kernels branch on agrees, and
#     torch runs at that capability natively: x86-64-v3 on an AVX2-only CPU) is skipped, as the main
#     run already tested exactly that code; FORCE_LEVELS=1 runs it anyway;
#   - alderlake (AVX2 + AVX-VNNI) for the quantized GEMM where this CPU has AVX-VNNI, else compile-only;
#   - compile-only: AMX (sapphirerapids) and aarch64 (Debian's cross compiler), so a misplaced #if
#     fails CI on whatever machine CI lands on. One pool compiles them all; each success is cached
#     by a hash of (sources + headers, flags, compiler, arch, torch), so an unchanged tree skips them.
# `--prepare` only builds what the levels need (their kernels, the compile checks, the cross compiler)
# into the caches, without tests: scripts/test-all.sh runs it beside the main pytest run.
# SKIP_CROSS=1 skips the aarch64 check where its compiler cannot be installed (never in CI).
# STAGES=file appends "stage<TAB>seconds<TAB>status" per stage to it (scripts/test-all.sh's table);
# PREPARE_PID=pid waits for that --prepare run to end before the compile-only checks (the levels'
# tests run meanwhile; a kernel it is still building is waited for by the build lock).
set -euo pipefail
PY=${PY:-.venv/bin/python}
STAGES=${STAGES:-}
PREPARE=0
if [ "${1:-}" = --prepare ]; then PREPARE=1; PREPARE_STAGES=$STAGES; STAGES=; fi  # one line for all of it
# The kernel tests and the engine tests whose assertions go through the kernels' arithmetic
# (batch/chunk invariance, prefix hits, preemption, speculation, quantized and hybrid models).
# Not the build machinery's own tests (locks, caches, level decisions): the same at every level.
# Since LLM() takes CONVEYOR_KERNEL_ARCH (session 7; before, these engine tests ran the native kernels at
# every level), the engine tests cost a level's real speed: x86-64-v3, the AVX2 laptops' level, runs all of
# them; the portable x86-64 and skylake-avx512 levels run the kernel tests and the plain and quantized engine
# invariance tests (their hybrid, speculation and KV-pressure tests added ~100 s to make test).
# EAGLE3's and DFlash's greedy == plain decoding (issue #43 item 2's bar: every level) at C=1 and 16, drafts rejected
# and accepted.
SHORT_LEVEL_TESTS=(tests/kernels tests/engine/test_engine.py tests/engine/test_quantized_engine.py
                   tests/engine/test_pooling.py::test_vector_alone_equals_vector_in_a_batch_of_32
                   tests/engine/test_pooling.py::test_long_input_is_chunked_for_last_token_pooling
                   tests/engine/test_eagle3.py::test_random_drafter_greedy_is_plain_decoding
                   tests/engine/test_eagle3.py::test_an_agreeing_drafter_has_its_drafts_accepted
                   tests/engine/test_dflash.py::test_random_drafter_greedy_is_plain_decoding
                   tests/engine/test_dflash.py::test_an_agreeing_drafter_has_its_drafts_accepted
                   --ignore=tests/kernels/test_build.py --ignore=tests/kernels/test_levels.py)
LEVEL_TESTS=("${SHORT_LEVEL_TESTS[@]}" tests/engine/test_speculative.py tests/engine/test_hybrid_engine.py
             tests/engine/test_kv_pressure_and_prefix.py
             tests/engine/test_eagle3.py::test_speculators_layout_and_its_layer_ids
             tests/engine/test_eagle3.py::test_partial_acceptance_stays_exact
             tests/engine/test_eagle3.py::test_prefix_hits_and_chunked_prefill_keep_greedy_exact
             tests/engine/test_eagle3.py::test_preemption_keeps_greedy_exact
             tests/engine/test_dflash.py::test_partial_acceptance_stays_exact
             tests/engine/test_dflash.py::test_prefix_hits_and_chunked_prefill_keep_greedy_exact
             tests/engine/test_dflash.py::test_preemption_keeps_greedy_exact)

if [ "$(uname -m)" != x86_64 ]; then
  echo "kernel levels: $(uname -m) host, only the native level (tested by the main run)"
  exit 0
fi

record() {  # stage, seconds, status
  echo "   ($1: $2 s, $3)"
  if [ -n "$STAGES" ]; then printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$STAGES"; fi
}

timed() {  # stage, command...: runs it, records its time; fails the script when it fails
  local name=$1 start=$SECONDS status=ok
  shift
  "$@" || status=FAILED
  record "$name" $((SECONDS - start)) "$status"
  [ "$status" = ok ]
}

same_as_native() {  # arch, torch capability
  [ "${FORCE_LEVELS:-0}" != 1 ] && "$PY" -m conveyor.kernels --same-as-native "$1" --torch-capability "$2"
}

level_archs=()
run_level() {  # arch, torch capability, oneDNN cap, [short: SHORT_LEVEL_TESTS]
  if same_as_native "$1" "$2"; then
    echo "== kernel level $1: skipped: same kernel build as native (the main run tested it) =="
    [ $PREPARE = 1 ] || record "level $1" 0 "skipped: same kernel build as native"
    return
  fi
  if [ $PREPARE = 1 ]; then level_archs+=("$1"); return; fi
  local tests=("${LEVEL_TESTS[@]}")
  if [ "${4:-}" = short ]; then tests=("${SHORT_LEVEL_TESTS[@]}"); fi
  echo "== kernel level $1 (torch $2, oneDNN $3) =="
  timed "level $1" env CONVEYOR_REQUIRE_KERNELS=1 CONVEYOR_KERNEL_ARCH="$1" ATEN_CPU_CAPABILITY="$2" \
    ONEDNN_MAX_CPU_ISA="$3" "$PY" -m pytest -q -x -p no:cacheprovider "${tests[@]}"
}

run_level x86-64-v3 avx2 AVX2
run_level x86-64 default SSE41 short
# The quantized GEMM has its own AVX-VNNI path (AVX2 + vpdpbusd, Alder Lake / Zen 5 laptops):
# tested where this CPU has AVX-VNNI, else compile-checked below.
if grep -qw avx_vnni /proc/cpuinfo; then
  if [ $PREPARE = 1 ]; then
    level_archs+=(alderlake)
  else
    echo "== kernel level alderlake (AVX-VNNI, quantized GEMM only) =="
    timed "level alderlake (qgemm)" env CONVEYOR_REQUIRE_KERNELS=1 CONVEYOR_KERNEL_ARCH=alderlake \
      ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 "$PY" -m pytest -q -x -p no:cacheprovider tests/kernels/test_qgemm.py
  fi
  vnni_compile=()
else
  vnni_compile=(--arch alderlake)
fi
if grep -qw avx512bw /proc/cpuinfo && grep -qw avx512vl /proc/cpuinfo && grep -qw avx512dq /proc/cpuinfo; then
  run_level skylake-avx512 avx512 AVX512_CORE short
  compile_only=(--arch sapphirerapids "${vnni_compile[@]}")
else
  compile_only=(--arch skylake-avx512 --arch sapphirerapids "${vnni_compile[@]}")
fi

if [ $PREPARE = 0 ] && [ -n "${PREPARE_PID:-}" ]; then
  # scripts/test-all.sh: its --prepare run may still be installing the cross compiler or compiling
  echo "== waiting for the compile checks started beside pytest (pid $PREPARE_PID) =="
  while kill -0 "$PREPARE_PID" 2>/dev/null; do sleep 1; done
fi
if [ "${SKIP_CROSS:-0}" = 1 ]; then
  echo "== compile-only aarch64: SKIPPED (SKIP_CROSS=1) =="
  [ $PREPARE = 1 ] || record "compile-only aarch64" 0 "skipped (SKIP_CROSS=1)"
else
  if ! command -v aarch64-linux-gnu-g++ >/dev/null; then
    echo "== installing Debian's aarch64 cross compiler (g++-aarch64-linux-gnu) =="
    SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
    install_cross() {
      $SUDO apt-get install -y -q g++-aarch64-linux-gnu >/dev/null \
        || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q g++-aarch64-linux-gnu >/dev/null; } \
        || { echo "cannot install g++-aarch64-linux-gnu: install it, or run with SKIP_CROSS=1" >&2; return 1; }
    }
    timed "install aarch64 cross compiler" install_cross
  fi
  compile_only+=(--target aarch64-linux-gnu-g++:armv8-a)
fi

if [ $PREPARE = 1 ]; then
  # Kernel builds one compiler at a time (each ~1.6 GB at -O3); checks one per CPU: under nice they take
  # only what pytest leaves idle, and once it ends they have both cores (measured: one job left one idle).
  for arch in "${level_archs[@]}"; do
    echo "== prepare: kernels for $arch =="
    "$PY" -m conveyor.kernels --build --jobs 1 --arch "$arch" || true  # the level's own run reports a failure
  done
  echo "== prepare: compile-only ${compile_only[*]} =="
  "$PY" -m conveyor.kernels "${compile_only[@]}" || true
  if [ -n "$PREPARE_STAGES" ]; then
    printf '%s\t%s\t%s\n' "levels prepared (beside pytest)" "$SECONDS" done >> "$PREPARE_STAGES"
  fi
  exit 0
fi

echo "== compile-only: ${compile_only[*]} =="
timed "compile-only checks" "$PY" -m conveyor.kernels "${compile_only[@]}"
