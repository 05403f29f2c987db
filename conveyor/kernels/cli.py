"""`python -m conveyor.kernels`: build the kernels into the shared cache, or check other levels' builds.

    --build [--arch A] [--jobs N]       build (or find cached) every kernel for A (default native): make setup
    --arch A [--arch B] [--cxx CXX]     compile-only checks, all on one pool, successes cached
    --target CXX:ARCH                   one more compile-only target with its own compiler (aarch64)
    --same-as-native A [--torch-capability CAP]
                                        exit 0 when A builds the same kernel code as native here (and torch
                                        would run at CAP natively): a level test run there would repeat native's
"""

from __future__ import annotations

import argparse
import logging
import time

from conveyor.kernels.build import KERNELS, build_times, load_kernel, load_kernels
from conveyor.kernels.checks import compile_checks, macro_differences


def _build(archs: list[str], jobs: int | None) -> int:
    failed = False
    for arch in archs:
        started = time.perf_counter()
        # --jobs 1: one compiler at a time, beside other work (scripts/kernel-levels.sh --prepare)
        builds = {k: load_kernel(k, arch) for k in KERNELS} if jobs == 1 else load_kernels(arch)
        for kernel in KERNELS:
            build = builds[kernel]
            status = ("compiled" if build.compiled else "cached") if build.module else f"FAILED: {build.error}"
            print(f"kernel {kernel} -march={arch}: {status}")
            failed |= build.module is None
        recorded = build_times().get(arch)
        measured = f", {recorded['cpu_s_per_kernel']:.0f} CPU s per kernel recorded" if recorded else ""
        print(f"  ({time.perf_counter() - started:.0f} s{measured})")
    return 1 if failed else 0


def _same_as_native(arch: str, torch_capability: str | None) -> int:
    try:
        differences = macro_differences(arch, "native")
    except Exception as exc:  # no compiler: the level runs, and says why it fails
        print(f"-march={arch}: cannot compare with native: {exc}")
        return 1
    if differences:
        shown = ", ".join(f"{m}={a or '-'}/{n or '-'}" for m, (a, n) in list(differences.items())[:6])
        print(f"-march={arch}: a different kernel build from native ({shown})")
        return 1
    if torch_capability is not None:
        import torch

        native = torch.backends.cpu.get_cpu_capability()
        if native.lower() != torch_capability.lower():
            print(f"-march={arch}: the same kernel build as native, but torch runs {native} natively, "
                  f"not {torch_capability}")
            return 1
    print(f"-march={arch}: the same kernel build as native (every macro the kernels branch on agrees)")
    return 0


def _check(targets: list[tuple[str, str]], use_cache: bool, jobs: int | None) -> int:
    started = time.perf_counter()
    results = compile_checks(targets, jobs=jobs, use_cache=use_cache)
    for r in results:
        status = "FAILED: " + r.error if r.error else ("ok (cached)" if r.cached else f"ok ({r.seconds:.0f} s)")
        print(f"{r.cxx} -march={r.arch} {r.kernel}: {status}")
    cached = sum(r.cached for r in results)
    print(f"  ({len(results)} compile checks, {cached} cached, {time.perf_counter() - started:.0f} s)")
    return 1 if any(r.error for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.kernels",
                                     description="Build the C++ kernels into the shared cache, or check other "
                                                 "ISA levels / targets (compile-only).")
    parser.add_argument("--build", action="store_true", help="build (or find cached) the kernels for --arch "
                                                             "(default native)")
    parser.add_argument("--arch", action="append", default=[], help="-march value (repeatable)")
    parser.add_argument("--cxx", default="c++", help="compiler for --arch checks (e.g. aarch64-linux-gnu-g++)")
    parser.add_argument("--target", action="append", default=[], metavar="CXX:ARCH",
                        help="a compile-only target with its own compiler (repeatable)")
    parser.add_argument("--no-cache", action="store_true", help="compile-check even what succeeded before")
    parser.add_argument("--jobs", type=int, default=None, help="compilers at once (checks: default one per CPU; --build: 1 = one at a time)")
    parser.add_argument("--same-as-native", metavar="ARCH", help="exit 0 when ARCH builds the same kernels as native")
    parser.add_argument("--torch-capability", help="with --same-as-native: the ATEN_CPU_CAPABILITY the level runs")
    args = parser.parse_args(argv)
    if args.same_as_native:
        return _same_as_native(args.same_as_native, args.torch_capability)
    if args.build:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        return _build(args.arch or ["native"], args.jobs)
    targets = [(args.cxx, arch) for arch in args.arch] + [tuple(t.split(":", 1)) for t in args.target]
    if not targets or any(len(t) != 2 for t in targets):
        parser.error("give --build, --same-as-native ARCH, or compile-check targets (--arch, --target CXX:ARCH)")
    return _check(targets, not args.no_cache, args.jobs)
