"""Our bf16 GEMM (conveyor/kernels/csrc/gemm.cpp) at one ISA level against oneDNN and F.linear.

The level is the one CONVEYOR_KERNEL_ARCH selects (read by conveyor.config.kernel_settings_from_env()),
so the same script measures every level this machine runs:

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 CONVEYOR_KERNEL_ARCH=x86-64-v3 python benchmarks/gemm_levels.py
    CONVEYOR_KERNEL_ARCH=skylake-avx512 python benchmarks/gemm_levels.py
    CONVEYOR_KERNEL_ARCH=native python benchmarks/gemm_levels.py

(ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA cap torch and oneDNN at the same level, as on an AVX2
machine.) Shapes are SmolLM2-135M's linears (out x in): qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536, lm_head 49152x576, at M = 1, 16, 32, 128, 512 rows. Columns:
- ours: RowInvariantLinear's path (gemm.pack once, gemm.linear per call, bf16 out);
- oneDNN bf16: torch.ops.mkldnn._linear_pointwise on a weight reordered for that M
  (_reorder_linear_weight(w, M)), RowInvariantLinear's fallback; n/a where oneDNN has no bf16
  linear (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, so not under ONEDNN_MAX_CPU_ISA=AVX2:
  there RowInvariantLinear falls back to F.linear);
- oneDNN fp32: the same in fp32 (x, weight and output fp32): what an AVX2 machine's oneDNN does at
  full speed, reading twice the weight bytes;
- F.linear: torch.nn.functional.linear on the plain (N, K) bf16 weight.
"best torch / ours" is the fastest torch column's time over ours (> 1: ours is faster).
Each call takes the next of several copies of the weight, enough copies for --stream-mb MB
(default 256, several times any L3 here), so weights come from memory as in a decode step, where
the other layers' weights pass through the caches in between (--stream-mb 0: one copy, the
cache-resident view). Each entry is the median over ~2 ms blocks of calls after warm-up, the
columns' blocks taken in turn (so load from other work falls on all of them alike), --seconds
per column and entry (at least 5 blocks each). GFLOP/s = 2 M N K / time;
"W GB/s" is our weight stream (bytes of the bf16 weight per call / time), the number to hold
against memory bandwidth at M = 1.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Callable

import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)
import torch

from conveyor.config import kernel_settings_from_env
from conveyor.kernels import cpu_backend
from offline_throughput import emit_table, machine

SHAPES = {  # name -> (out_features N, in_features K)
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def block_timer(fn: Callable[[], object], block_s: float = 0.002) -> Callable[[], float]:
    """Warms `fn` up and returns a timer of one block of calls (~block_s): seconds per call."""
    for _ in range(3):
        fn()
    start = time.perf_counter()
    fn()
    calls = max(1, int(block_s / max(time.perf_counter() - start, 1e-7)))

    def block() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls

    return block


def time_interleaved(fns: dict[str, Callable[[], object]], seconds: float, min_rounds: int = 5) -> dict[str, float]:
    """Median seconds per call of each fn, timed in rounds that take one short block of each in
    turn, for about `seconds` per fn (at least min_rounds). On a shared machine a preempted thread
    spoils a few blocks, not all (the median keeps out of them), and whatever load comes and goes
    falls on every column alike, so the ratios hold even when the absolute times drift."""
    timers = {name: block_timer(fn) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    spent: dict[str, float] = {name: 0.0 for name in fns}
    rounds = 0
    while rounds < min_rounds or min(spent.values()) < seconds:
        for name, timer in timers.items():
            start = time.perf_counter()
            samples[name].append(timer())
            spent[name] += time.perf_counter() - start
        rounds += 1
        if rounds >= 1000:
            break
    return {name: statistics.median(v) for name, v in samples.items()}


def cycling(fns: list[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs the next of `fns` on each call (one per weight copy)."""
    state = {"i": 0}

    def call() -> object:
        i = state["i"]
        state["i"] = (i + 1) % len(fns)
        return fns[i]()

    return call


def onednn_calls(x: torch.Tensor, weights: list[torch.Tensor], m: int) -> Callable[[], object] | None:
    """oneDNN's linear in x's dtype on weights reordered for M rows; None where oneDNN has no such
    path (bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: not under ONEDNN_MAX_CPU_ISA=AVX2)."""
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w.to(x.dtype), m) for w in weights]
    except (RuntimeError, AttributeError):
        return None
    return cycling([lambda p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed])


def read_bandwidth(seconds: float) -> float:
    """GB/s of torch.sum over 256 MB of fp32 (this process's threads): the M = 1 yardstick."""
    data = torch.ones(64 * 2**20)
    return data.numel() * 4 / time_interleaved({"sum": lambda: data.sum()}, seconds)["sum"] / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="1,16,32,128,512")
    parser.add_argument("--stream-mb", type=float, default=256, help="cycle weight copies totalling this much")
    parser.add_argument("--seconds", type=float, default=1.0, help="timing per column and entry (at least 5 blocks)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-torch", action="store_true", help="only our GEMM (skip oneDNN and F.linear)")
    parser.add_argument("--out", default=None, help="append the markdown table to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    backend = cpu_backend(kernel_settings_from_env())
    if backend.gemm is None:
        raise SystemExit(f"our GEMM did not build: {backend.errors.get('gemm')}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(1, math.ceil(args.stream_mb * 2**20 / (n * k * 2)))
        weights = [(torch.randn(n, k, generator=gen) * 0.05).bfloat16() for _ in range(copies)]
        packed = [backend.gemm.pack(w) for w in weights]
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k, generator=gen).bfloat16()
            flops = 2.0 * m * n * k
            fns = {"ours": cycling([lambda p=p: backend.gemm.linear(x, p, n, None) for p in packed])}
            if not args.no_torch:
                fns["onednn_bf16"] = onednn_calls(x, weights, m)
                fns["onednn_fp32"] = onednn_calls(x.float(), weights, m)
                fns["linear"] = cycling([lambda w=w: torch.nn.functional.linear(x, w) for w in weights])
            times = time_interleaved({key: fn for key, fn in fns.items() if fn is not None}, args.seconds)
            del fns
            ours = times["ours"]
            row = [name, f"{n}x{k}", str(m), f"{ours * 1e3:.3f}", f"{flops / ours / 1e9:.1f}",
                   f"{n * k * 2 / ours / 1e9:.1f}"]
            if not args.no_torch:
                theirs = [times.get(key) for key in ("onednn_bf16", "onednn_fp32", "linear")]
                for t in theirs:
                    row += ["n/a", "n/a"] if t is None else [f"{t * 1e3:.3f}", f"{flops / t / 1e9:.1f}"]
                row.append(f"{min(t for t in theirs if t is not None) / ours:.2f}")
            rows.append(row)
            print(" | ".join(row), flush=True)
        del weights, packed
    header = ["shape", "N x K", "M", "ours ms", "ours GFLOP/s", "ours W GB/s"]
    if not args.no_torch:
        header += ["oneDNN bf16 ms", "GFLOP/s", "oneDNN fp32 ms", "GFLOP/s", "F.linear ms", "GFLOP/s",
                   "best torch / ours"]
    bandwidth = read_bandwidth(args.seconds)
    caption = (f"bf16 GEMM, ours = {backend.gemm.backend()} (built for -march={backend.arch}) vs torch "
               f"(ATen CPU capability {torch.backends.cpu.get_cpu_capability()}). Machine: {machine()}. "
               f"Medians over ~2 ms blocks of calls, the columns' blocks interleaved ({args.seconds:g} s per column "
               f"and entry); bf16 weights cycled over copies totalling >= {args.stream_mb:.0f} MB. "
               f"Read bandwidth (torch.sum, 256 MB fp32): {bandwidth:.1f} GB/s.")
    emit_table(caption, header, rows, args.out)


if __name__ == "__main__":
    main()
