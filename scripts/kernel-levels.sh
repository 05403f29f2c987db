#!/usr/bin/env bash
# The C++ kernels at every ISA level this one machine can reach (part of `make test`):
#   - built and tested for real: x86-64-v3 (AVX2+FMA, with torch and oneDNN capped at AVX2 too, as on
#     an AVX2 laptop) and x86-64 (baseline, the portable path), plus skylake-avx512 (AVX-512 without
#     BF16) where this CPU runs it: the kernel, invariance and speculation tests, kernels required;
#   - alderlake (AVX2 + AVX-VNNI) for the quantized GEMM where this CPU has AVX-VNNI, else compile-only;
#   - compile-only: AMX (sapphirerapids) and aarch64 (Debian's cross compiler), so a misplaced #if
#     fails CI on whatever machine CI lands on.
# SKIP_CROSS=1 skips the aarch64 check where its compiler cannot be installed (never in CI).
set -euo pipefail
PY=${PY:-.venv/bin/python}
LEVEL_TESTS=(tests/kernels tests/engine/test_engine.py tests/engine/test_speculative.py tests/engine/test_quantized_engine.py tests/engine/test_hybrid_engine.py
             tests/engine/test_kv_pressure_and_prefix.py)

if [ "$(uname -m)" != x86_64 ]; then
  echo "kernel levels: $(uname -m) host, only the native level (tested by the main run)"
  exit 0
fi

run_level() {  # arch, torch capability, oneDNN cap
  echo "== kernel level $1 (torch $2, oneDNN $3) =="
  CONVEYOR_REQUIRE_KERNELS=1 CONVEYOR_KERNEL_ARCH="$1" ATEN_CPU_CAPABILITY="$2" ONEDNN_MAX_CPU_ISA="$3" \
    "$PY" -m pytest -q -x -p no:cacheprovider "${LEVEL_TESTS[@]}"
}

run_level x86-64-v3 avx2 AVX2
run_level x86-64 default SSE41
# The quantized GEMM has its own AVX-VNNI path (AVX2 + vpdpbusd, Alder Lake / Zen 5 laptops):
# tested where this CPU has AVX-VNNI, else compile-checked below.
if grep -qw avx_vnni /proc/cpuinfo; then
  echo "== kernel level alderlake (AVX-VNNI, quantized GEMM only) =="
  CONVEYOR_REQUIRE_KERNELS=1 CONVEYOR_KERNEL_ARCH=alderlake ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
    "$PY" -m pytest -q -x -p no:cacheprovider tests/kernels/test_qgemm.py
  vnni_compile=()
else
  vnni_compile=(--arch alderlake)
fi
if grep -qw avx512bw /proc/cpuinfo && grep -qw avx512vl /proc/cpuinfo && grep -qw avx512dq /proc/cpuinfo; then
  run_level skylake-avx512 avx512 AVX512_CORE
  compile_only=(--arch sapphirerapids "${vnni_compile[@]}")
else
  compile_only=(--arch skylake-avx512 --arch sapphirerapids "${vnni_compile[@]}")
fi

echo "== compile-only: ${compile_only[*]} =="
"$PY" -m conveyor.kernels "${compile_only[@]}"

if [ "${SKIP_CROSS:-0}" = 1 ]; then
  echo "== compile-only aarch64: SKIPPED (SKIP_CROSS=1) =="
  exit 0
fi
if ! command -v aarch64-linux-gnu-g++ >/dev/null; then
  echo "== installing Debian's aarch64 cross compiler (g++-aarch64-linux-gnu) =="
  SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
  $SUDO apt-get install -y -q g++-aarch64-linux-gnu >/dev/null \
    || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q g++-aarch64-linux-gnu >/dev/null; } \
    || { echo "cannot install g++-aarch64-linux-gnu: install it, or run with SKIP_CROSS=1" >&2; exit 1; }
fi
echo "== compile-only: aarch64 =="
"$PY" -m conveyor.kernels --cxx aarch64-linux-gnu-g++ --arch armv8-a
