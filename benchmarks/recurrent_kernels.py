"""Recurrent kernels (csrc/recurrent.cpp) at a real model's shapes, one decode step of S sequences x 1 token:
the gated delta rule, its SiLU short conv and the gated norm (Qwen3.5-2B's DeltaNet: 16 key / 16 value heads of
128, conv over 6,144 channels, width 4), LFM2's short conv, and a prefill chunk. Median ms per call over many calls.

Usage:
  PYTHONPATH=$PWD python benchmarks/recurrent_kernels.py [--sequences 16] [--repeats 200] [--prefill 256]

For an A/B against another checkout run it with PYTHONPATH pointing there (each source builds its own module).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conveyor.kernels.backend import cpu_backend  # noqa: E402
from conveyor.kernels.recurrent import StateMetadata  # noqa: E402


def timed(fn, repeats: int, clock=time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--prefill", type=int, default=256, help="tokens of the one-sequence prefill rows (0: none)")
    p.add_argument("--threads", type=int, default=0, help="0: torch's default; 1: timed in thread CPU time, "
                   "which a busy machine does not inflate")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    ops = cpu_backend()
    kernels = ops.recurrent
    gen = torch.Generator().manual_seed(0)
    S, Hk, Hv, dk, dv, K = args.sequences, 16, 16, 128, 128, 4
    conv_channels = 2 * Hk * dk + Hv * dv
    slots = S + 2
    rows = []

    def case(name: str, T: int, n_seq: int, counts: list[int]) -> None:
        meta = StateMetadata.build(counts, list(range(n_seq)), [False] * n_seq)
        bf = torch.bfloat16
        x = torch.randn(T, conv_channels, generator=gen).to(bf)
        conv_w = torch.randn(conv_channels, K, generator=gen) * 0.3
        conv_state = torch.randn(slots, conv_channels, K - 1, generator=gen)
        q = torch.randn(T, Hk, dk, generator=gen).to(bf)
        k = torch.randn(T, Hk, dk, generator=gen).to(bf)
        v = torch.randn(T, Hv, dv, generator=gen).to(bf)
        a, b = (torch.randn(T, Hv, generator=gen).to(bf) for _ in range(2))
        A_log, dt_bias = torch.randn(Hv, generator=gen) * 0.1, torch.randn(Hv, generator=gen) * 0.1
        ssm_state = torch.randn(slots, Hv, dk, dv, generator=gen) * 0.01
        core = torch.randn(T * Hv, dv, generator=gen).to(bf)
        z = torch.randn(T * Hv, dv, generator=gen).to(bf)
        norm_w = torch.randn(dv, generator=gen).to(bf)
        lfm_x = torch.randn(T, 2048, generator=gen).to(bf)
        lfm_w = torch.randn(2048, 3, generator=gen)
        lfm_state = torch.randn(slots, 2048, 2, generator=gen)
        reps = max(3, args.repeats // max(1, T // n_seq))
        rows.append((name, "short_conv (6144 ch, SiLU)", timed(
            lambda: kernels.short_conv(x, conv_w, None, conv_state, *meta.args(), True), reps, clock)))
        rows.append((name, "gated_delta_rule (16 heads, 128x128)", timed(
            lambda: kernels.gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ssm_state, *meta.args()), reps, clock)))
        rows.append((name, "gated_rms_norm (16 heads of 128)", timed(
            lambda: kernels.gated_rms_norm(core, z, norm_w, 1e-6, dv, True), reps, clock)))
        rows.append((name, "LFM2 short_conv (2048 ch, width 3)", timed(
            lambda: kernels.short_conv(lfm_x, lfm_w, None, lfm_state, *meta.args(), False), reps, clock)))

    case(f"decode {S} x 1", S, S, [1] * S)
    if args.prefill:
        case(f"prefill 1 x {args.prefill}", args.prefill, 1, [args.prefill])
    print(f"recurrent kernels ({kernels.isa()}), threads {torch.get_num_threads()} "
          f"({'thread CPU' if clock is time.thread_time else 'wall'} time), median of {args.repeats}")
    print("| step | kernel | ms / call |")
    print("|---|---|---|")
    for name, kernel, ms in rows:
        print(f"| {name} | {kernel} | {ms:.3f} |")


if __name__ == "__main__":
    main()
