"""Our GEMM kernels on a busy machine: one "decode step" of linears, quiet and beside CPU hogs (issue #19).

Usage:
  PYTHONPATH=$PWD python benchmarks/kernel_contention.py [--hogs 0,2] [--threads 1,2] [--m 1,16]
                                                          [--steps 200] [--kernel gemm,qgemm]

A step is every linear of SmolLM2-135M's 30 layers (qkv 576->960, o 576->576, gate_up 576->3072,
down 1536->576) at M rows, through our bf16 GEMM (`gemm`) or the quantized one at Q8_0 (`qgemm`).
For each (hogs, threads, M) it reports the wall time per step (median, p90, max), the process CPU
time per step (all threads), and the involuntary context switches. Hogs are `yes > /dev/null`
processes started here and killed on exit. Other load on the machine shows up in the figures:
compare builds in alternating runs (e.g. this script from two checkouts, one after the other).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import time
from contextlib import contextmanager
from collections.abc import Iterator

import torch

from conveyor.kernels.build import load_kernels
from conveyor.testing import random_raw

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out_features, in_features) per layer
Q8_0 = 8


@contextmanager
def hogs(count: int) -> Iterator[None]:
    """`count` busy processes beside the measurement (what a shared box or a busy CI runner does)."""
    procs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(count)]
    try:
        time.sleep(0.5 if count else 0)  # let the scheduler see them running
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def linears(kernel: str) -> list:
    """One callable per linear of a step, x -> y, with weights packed the way the server packs them."""
    mods = load_kernels("native")
    calls = []
    for n, k in SHAPES:
        if kernel == "gemm":
            packed = mods["gemm"].module.pack(torch.randn(n, k).bfloat16())
            calls.append((k, lambda x, p=packed, n=n: mods["gemm"].module.linear(x, p, n, None)))
        else:
            packed = mods["qgemm"].module.pack(random_raw(Q8_0, n, k), Q8_0, k)
            calls.append((k, lambda x, p=packed, n=n, k=k: mods["qgemm"].module.linear(x, p, Q8_0, n, k, None)))
    return calls


def measure(calls: list, m: int, steps: int) -> dict[str, float]:
    inputs = {k: torch.randn(m, k).bfloat16() for k, _ in calls}
    for _ in range(3):  # warm-up: thread pool, per-thread buffers
        for k, fn in calls:
            fn(inputs[k])
    walls = []
    usage0, cpu0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
    for _ in range(steps):
        start = time.perf_counter()
        for _ in range(LAYERS):
            for k, fn in calls:
                fn(inputs[k])
        walls.append(time.perf_counter() - start)
    usage1, cpu1 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
    walls.sort()
    return {"wall_ms_p50": 1e3 * statistics.median(walls), "wall_ms_p90": 1e3 * walls[int(0.9 * (len(walls) - 1))],
            "wall_ms_max": 1e3 * walls[-1], "cpu_ms": 1e3 * (cpu1 - cpu0) / steps,
            "invol_switches": (usage1.ru_nivcsw - usage0.ru_nivcsw) / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hogs", default="0,2", help="comma list of CPU hog counts")
    parser.add_argument("--threads", default="1,2", help="comma list of torch thread counts")
    parser.add_argument("--m", default="1,16", help="comma list of rows per call")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kernel", default="gemm", help="gemm and/or qgemm (comma list)")
    args = parser.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    print(f"{'kernel':6} {'hogs':>4} {'thr':>3} {'M':>3} {'p50 ms':>8} {'p90 ms':>8} {'max ms':>8} "
          f"{'cpu ms':>8} {'invol/step':>10}")
    for kernel in args.kernel.split(","):
        calls = linears(kernel)
        for count in ints(args.hogs):
            with hogs(count):
                for threads in ints(args.threads):
                    torch.set_num_threads(threads)
                    for m in ints(args.m):
                        r = measure(calls, m, args.steps)
                        print(f"{kernel:6} {count:4} {threads:3} {m:3} {r['wall_ms_p50']:8.2f} {r['wall_ms_p90']:8.2f} "
                              f"{r['wall_ms_max']:8.2f} {r['cpu_ms']:8.2f} {r['invol_switches']:10.1f}", flush=True)


if __name__ == "__main__":
    main()
