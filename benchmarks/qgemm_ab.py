"""A/B of qgemm.cpp variants on one core: CPU time, interleaved repeats, 1B-class layer shapes.

Each variant is a source file plus -D flags (`name:path:FLAG1,FLAG2`, path empty = this checkout's
qgemm.cpp), compiled as its own extension. Per type and M, the variants run back to back in every
repeat (so load on a shared machine hits them alike); the report is each variant's best time, its
weight GB/s, the ratio of the first variant's time to its own, and whether the outputs are the same
bits. `--stream` first measures one core's streaming read (an AVX2 pass over 256 MiB), the limit
M = 1 decode is measured against.

    python benchmarks/qgemm_ab.py "main:/tmp/main.cpp:;new::" --types Q4_K,Q6_K --rows 1,16 --stream [--arch x86-64-v3]
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

import gguf
import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)
import torch
from torch.utils.cpp_extension import load, load_inline

from conveyor.kernels.build import CSRC, compile_flags
from conveyor.testing import random_raw

Q = gguf.GGMLQuantizationType
LAYER = [(2048, 3072), (2048, 16384), (8192, 2048)]  # (in_features, out_features): qkv, gate|up, down


def _build(src: Path, defines: list[str], arch: str = "native"):
    flags = compile_flags(arch) + [f"-D{d}" for d in defines]
    tag = hashlib.sha1((src.read_text() + str(flags)).encode()).hexdigest()[:8]
    return load(name=f"qab_{tag}", sources=[str(src)], extra_cflags=flags, extra_include_paths=[str(CSRC)],
                extra_ldflags=["-fopenmp"], verbose=False)


_STREAM_SRC = """
#include <torch/extension.h>
#include <immintrin.h>
// Reads every byte once: 8 independent 256-bit xor chains over 256 B per step (no compute to hide),
// with the hardware prefetcher alone (hint < 0) or with a software prefetch 3 KB ahead, as the kernel's
// decode walks do (hint 0: prefetchnta, AMD's; 2: prefetcht1, the others').
int64_t stream_read(const torch::Tensor& buf, int64_t hint) {
  const auto* p = reinterpret_cast<const __m256i*>(buf.data_ptr<uint8_t>());
  const int64_t n = buf.numel() / 256;
  __m256i a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_si256();
  for (int64_t i = 0; i < n; ++i) {
    const char* ahead = reinterpret_cast<const char*>(p + 8 * i) + 3072;
    if (hint == 0)
      for (int line = 0; line < 256; line += 64) __builtin_prefetch(ahead + line, 0, 0);
    else if (hint == 2)
      for (int line = 0; line < 256; line += 64) __builtin_prefetch(ahead + line, 0, 2);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_xor_si256(a[j], _mm256_load_si256(p + 8 * i + j));
  }
  for (int j = 1; j < 8; ++j) a[0] = _mm256_xor_si256(a[0], a[j]);
  return _mm256_extract_epi64(a[0], 0);
}
"""


def stream_gbs(hint: int, repeats: int = 7) -> float:
    """One core's streaming read: best of `repeats` AVX2 passes over 256 MiB (CPU time); `hint` as stream_read's."""
    mod = load_inline("qgemm_ab_stream", cpp_sources=[_STREAM_SRC], functions=["stream_read"],
                      extra_cflags=compile_flags("native"), verbose=False)
    buf = torch.ones(256 << 20, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        mod.stream_read(buf, hint)
        best = min(best, time.thread_time() - start)
    return buf.numel() / best / 1e9


def _time_once(fn, reps: int) -> float:
    start = time.thread_time()
    for _ in range(reps):
        fn()
    return (time.thread_time() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", help='"name:path:DEF1,DEF2;name2:path2:" (path empty = csrc/qgemm.cpp)')
    parser.add_argument("--types", default="Q4_K")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--arch", default="native", help="-march level of every variant (e.g. x86-64-v3: plain AVX2)")
    parser.add_argument("--stream", action="store_true", help="measure one core's read bandwidth first")
    parser.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in LAYER),
                        help="in x out features per matrix (default: a 1B layer; Gemma 3 270M's head: 640x262144)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    mods = {}
    for spec in args.variants.split(";"):
        name, path, defs = (spec.split(":") + ["", ""])[:3]
        mods[name] = _build(Path(path) if path else CSRC / "qgemm.cpp", [d for d in defs.split(",") if d], args.arch)
    if args.stream:
        print(f"one core's streaming read: {stream_gbs(-1):.1f} GB/s (hardware prefetch), "
              f"{stream_gbs(0):.1f} GB/s (+ prefetchnta 3 KB ahead), {stream_gbs(2):.1f} GB/s (+ prefetcht1)", flush=True)
    for tname in args.types.split(","):
        qt = int(Q[tname])
        raws = [(random_raw(qt, n, k), n, k) for k, n in shapes]
        packed = {name: [(m.pack(r, qt, k), n, k) for r, n, k in raws] for name, m in mods.items()}
        # NOTE: one copy of the weights for all variants where their layouts agree: two allocations of the
        # same bytes measured up to 1.2x apart (A/A), from where their pages landed, not from the code.
        first = next(iter(packed.values()))
        for name, ps in packed.items():
            if all(torch.equal(a, b) for (a, _, _), (b, _, _) in zip(ps, first)):
                packed[name] = first
        nbytes = sum(p.numel() for p, _, _ in first)
        for rows in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(rows, k).bfloat16() for k, _ in shapes]
            fns = {name: (lambda mod=mods[name], ps=packed[name]: [mod.linear(x, p, qt, n, k, None)
                                                                   for (p, n, k), x in zip(ps, xs)])
                   for name in mods}
            outs = {name: fn() for name, fn in fns.items()}
            reps = 5 if rows <= 4 else 2
            best = {name: float("inf") for name in fns}
            for _ in range(args.repeats):  # interleaved: every repeat runs each variant once
                for name, fn in fns.items():
                    best[name] = min(best[name], _time_once(fn, reps))
            first = next(iter(outs.values()))
            same = all(all(torch.equal(a, b) for a, b in zip(o, first)) for o in outs.values())
            base = next(iter(best.values()))
            cells = " ".join(f"{n}: {t * 1e3:.2f} ms ({nbytes / t / 1e9:.1f} GB/s, x{base / t:.2f})"
                             for n, t in best.items())
            print(f"{tname} M={rows} {cells} {'bits-equal' if same else 'bits differ'}", flush=True)


if __name__ == "__main__":
    main()
