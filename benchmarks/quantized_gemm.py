"""The quantized GEMM per GGML type and row count, against our bf16 GEMM, on one 1B-class layer.

Shapes are one Llama-3.2-1B-sized decoder layer (hidden 2048, 8 KV heads of 64, FFN 8192):
fused qkv (2048 -> 3072), fused gate|up (2048 -> 16384), down (8192 -> 2048). Reports, per type
and M, the time per layer, the weight bytes streamed per second, the multiply-accumulates per second
(TMAC/s) and their share of the level's int8 peak: what the threads can issue at best, measured by
`qgemm.int8_peak_macs()` (a register-only loop of full AMX tiles or VNNI products, per thread, times
the threads; best of 5). `--cpu-time` times with the thread's CPU clock on one thread (a busy shared
machine then still gives comparable numbers).

    python benchmarks/quantized_gemm.py [--types Q4_K,Q6_K] [--rows 1,16,64] [--threads 2] [--cpu-time]
    python benchmarks/quantized_gemm.py --types Q4_K,Q6_K,Q8_0 --rows 64,256,512   # issue #43's prefill sizes
"""

from __future__ import annotations

import argparse
import time

import gguf
import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)
import torch

from conveyor.config import kernel_settings_from_env
from conveyor.kernels import cpu_backend
from conveyor.testing import random_raw

Q = gguf.GGMLQuantizationType
LAYER = [(2048, 3072), (2048, 16384), (8192, 2048)]  # (in_features, out_features)
MACS_PER_ROW = sum(k * n for k, n in LAYER)


def _time(fn, reps: int, clock) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(3):
        start = clock()
        for _ in range(reps):
            fn()
        best = min(best, (clock() - start) / reps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q4_K,Q5_K,Q6_K,MXFP4")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU clock")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 GEMM rows (x bf16 then reads '-')")
    args = parser.parse_args()
    if args.cpu_time:
        torch.set_num_threads(1)
    elif args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    backend = cpu_backend(kernel_settings_from_env())
    rows = [int(m) for m in args.rows.split(",")]
    threads = torch.get_num_threads()
    measure = getattr(backend.qgemm, "int8_peak_macs", lambda: 0.0)  # absent in builds before issue #43
    peak = threads * max(measure() for _ in range(5))  # MAC/s; 0: not measured
    print(f"quantized GEMM {backend.qgemm.backend()} (decode prefetch {backend.qgemm.decode_prefetch()}), "
          f"bf16 GEMM {backend.gemm.backend()}, {threads} thread(s), {'CPU' if args.cpu_time else 'wall'} time; "
          f"int8 peak {peak / 1e12:.2f} TMAC/s ({threads} x one thread's)")
    print("| weights | M | ms / layer | weight GB/s | x bf16 | TMAC/s | % of int8 peak |")
    print("|---|---|---|---|---|---|---|")

    def rates(m: int, ms: float) -> str:
        tmacs = m * MACS_PER_ROW / ms / 1e9
        return f"{tmacs:.3f} | {100 * tmacs * 1e12 / peak:.1f}" if peak else f"{tmacs:.3f} | -"

    dense = [(backend.gemm.pack((torch.randn(n, k) * 0.05).bfloat16()), n, k) for k, n in LAYER]
    bf16_ms = {}
    for m in rows if not args.no_bf16 else []:
        xs = [torch.randn(m, k).bfloat16() for k, _ in LAYER]
        reps = 10 if m == 1 else 3
        ms = sum(_time(lambda p=p, n=n, x=x: backend.gemm.linear(x, p, n, None), reps, clock)
                 for (p, n, _), x in zip(dense, xs)) * 1e3
        bf16_ms[m] = ms
        nbytes = sum(p.numel() * 2 for p, _, _ in dense)
        print(f"| bf16 | {m} | {ms:.2f} | {nbytes / ms / 1e6:.1f} | 1.00 | {m * MACS_PER_ROW / ms / 1e9:.3f} | - |",
              flush=True)
    for name in args.types.split(","):
        qtype = int(Q[name])
        packed = [(backend.pack_quantized(random_raw(qtype, n, k), qtype, k), n, k) for k, n in LAYER]
        nbytes = sum(p.numel() for p, _, _ in packed)
        for m in rows:
            xs = [torch.randn(m, k).bfloat16() for k, _ in LAYER]
            reps = 10 if m == 1 else 3
            ms = sum(_time(lambda p=p, n=n, k=k, x=x: backend.quantized_linear(x, p, qtype, n, k, None), reps, clock)
                     for (p, n, k), x in zip(packed, xs)) * 1e3
            vs_bf16 = f"{bf16_ms[m] / ms:.2f}" if m in bf16_ms else "-"
            print(f"| {name} | {m} | {ms:.2f} | {nbytes / ms / 1e6:.1f} | {vs_bf16} | {rates(m, ms)} |",
                  flush=True)


if __name__ == "__main__":
    main()
