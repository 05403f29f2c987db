"""Our GEMM kernels on a busy machine: one "decode step" of linears, quiet and beside CPU hogs (issue #19).

Usage:
  PYTHONPATH=$PWD python benchmarks/kernel_contention.py [--hogs 0,2] [--threads 1,2] [--m 1,16]
                                                          [--steps 200] [--kernel gemm,qgemm] [--baseline DIR]

A step is every linear of SmolLM2-135M's 30 layers (qkv 576->960, o 576->576, gate_up 576->3072,
down 1536->576) at M rows, through our bf16 GEMM (`gemm`) or the quantized one at Q8_0 (`qgemm`).
For each (hogs, threads, M) it reports the wall time per step (median, p90, max), the process CPU
time per step (all threads), and the involuntary context switches. Hogs are `yes > /dev/null`
processes started here and killed on exit. Other load on the machine shows up in the figures, so
`--baseline DIR` loads a second build of the kernels from another checkout (its own
conveyor/kernels/build.py and csrc) into this process and alternates steps between the two
(rows `base` and `this`): both see the same load.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from collections.abc import Iterator

import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)
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


def kernel_modules(checkout: str | None) -> dict:
    """gemm and qgemm built from this package, or from another checkout's sources (--baseline)."""
    if checkout is None:
        return {k: b.module for k, b in load_kernels("native").items()}
    spec = importlib.util.spec_from_file_location("baseline_build", f"{checkout}/conveyor/kernels/build.py")
    build = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = build  # dataclasses look their module up
    spec.loader.exec_module(build)
    return {k: build.load_kernel(k, "native").module for k in ("gemm", "qgemm")}


def linears(mods: dict, kernel: str) -> list:
    """One callable per linear of a step, x -> y, with weights packed the way the server packs them."""
    calls = []
    for n, k in SHAPES:
        if kernel == "gemm":
            packed = mods["gemm"].pack(torch.randn(n, k).bfloat16())
            calls.append((k, lambda x, p=packed, n=n: mods["gemm"].linear(x, p, n, None)))
        else:
            packed = mods["qgemm"].pack(random_raw(Q8_0, n, k), Q8_0, k)
            calls.append((k, lambda x, p=packed, n=n, k=k: mods["qgemm"].linear(x, p, Q8_0, n, k, None)))
    return calls


def measure(variants: dict[str, list], m: int, steps: int) -> dict[str, dict[str, float]]:
    """Steps of each variant, interleaved (ABBA order) so that they share the machine's load."""
    inputs = {k: torch.randn(m, k).bfloat16() for _, k in SHAPES}
    for calls in variants.values():
        for _ in range(3):  # warm-up: thread pool, per-thread buffers
            for k, fn in calls:
                fn(inputs[k])
    walls = {name: [] for name in variants}
    cpu = dict.fromkeys(variants, 0.0)
    switches = dict.fromkeys(variants, 0)
    names = list(variants)
    for step in range(steps):
        for name in names if step % 2 == 0 else names[::-1]:
            usage0, cpu0, start = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
            for _ in range(LAYERS):
                for k, fn in variants[name]:
                    fn(inputs[k])
            walls[name].append(time.perf_counter() - start)
            cpu[name] += time.process_time() - cpu0
            switches[name] += resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw - usage0.ru_nivcsw
    out = {}
    for name, w in walls.items():
        w.sort()
        out[name] = {"wall_ms_p50": 1e3 * statistics.median(w), "wall_ms_p90": 1e3 * w[int(0.9 * (len(w) - 1))],
                     "wall_ms_max": 1e3 * w[-1], "cpu_ms": 1e3 * cpu[name] / steps,
                     "invol_switches": switches[name] / steps}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hogs", default="0,2", help="comma list of CPU hog counts")
    parser.add_argument("--threads", default="1,2", help="comma list of torch thread counts")
    parser.add_argument("--m", default="1,16", help="comma list of rows per call")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kernel", default="gemm", help="gemm and/or qgemm (comma list)")
    parser.add_argument("--baseline", help="another checkout whose kernels run interleaved with these")
    args = parser.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    builds = {"this": kernel_modules(None)}
    if args.baseline:
        builds = {"base": kernel_modules(args.baseline), **builds}
    print(f"{'kernel':6} {'build':5} {'hogs':>4} {'thr':>3} {'M':>3} {'p50 ms':>8} {'p90 ms':>8} {'max ms':>8} "
          f"{'cpu ms':>8} {'invol/step':>10}")
    for kernel in args.kernel.split(","):
        variants = {name: linears(mods, kernel) for name, mods in builds.items()}
        for count in ints(args.hogs):
            with hogs(count):
                for threads in ints(args.threads):
                    torch.set_num_threads(threads)
                    for m in ints(args.m):
                        for name, r in measure(variants, m, args.steps).items():
                            print(f"{kernel:6} {name:5} {count:4} {threads:3} {m:3} {r['wall_ms_p50']:8.2f} "
                                  f"{r['wall_ms_p90']:8.2f} {r['wall_ms_max']:8.2f} {r['cpu_ms']:8.2f} "
                                  f"{r['invol_switches']:10.1f}", flush=True)


if __name__ == "__main__":
    main()
