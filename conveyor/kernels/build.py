"""Compiling and loading our C++ CPU kernels: one extension module per kernel, per ISA level.

Each kernel (gemm, attention, fused_ops, qgemm, recurrent) is its own module, so a compiler problem in one
costs only that one (and is reported), never the others. `arch` is the `-march` value
(CONVEYOR_KERNEL_ARCH, default native): one machine can build, test and compile-check every
level. Builds are cached (torch.utils.cpp_extension, ~/.cache/torch_extensions) under a name
keyed by the arch and this CPU's feature flags, so a home directory shared between machines
never hands a CPU a library it cannot run; a level the CPU lacks is refused before loading.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import platform
import re
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

KERNELS = ("gemm", "attention", "fused_ops", "qgemm", "recurrent")
CSRC = Path(__file__).parent / "csrc"

# Compiler macro -> the CPU flag (/proc/cpuinfo spelling) a binary built with it needs.
_X86_FEATURE_MACROS = {
    "__SSE4_2__": "sse4_2", "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c",
    "__BMI2__": "bmi2", "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512VL__": "avx512vl",
    "__AVX512DQ__": "avx512dq", "__AVX512VNNI__": "avx512_vnni", "__AVX512BF16__": "avx512_bf16",
    "__AMX_TILE__": "amx_tile", "__AMX_BF16__": "amx_bf16",
}


@dataclass(frozen=True)
class KernelBuild:
    """One kernel's outcome: the loaded module, or why there is none (the compiler's first error)."""

    kernel: str
    module: ModuleType | None
    error: str | None = None


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


@lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """This CPU's feature flags (Linux /proc/cpuinfo, macOS sysctl); empty where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        match = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", text, re.MULTILINE)
        if match:
            return frozenset(match.group(1).split())
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["sysctl", "-a"], capture_output=True, text=True, timeout=10).stdout
            return frozenset(line.split(":")[0].rsplit(".", 1)[-1].lower() for line in out.splitlines()
                             if line.startswith("hw.optional.") and line.rstrip().endswith(": 1"))
        except (OSError, subprocess.SubprocessError):
            pass
    return frozenset()


def cpu_model() -> str:
    try:
        match = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
        if match:
            return match.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def arch_flags(arch: str) -> list[str]:
    if arch != "native":
        return [f"-march={arch}"]
    if is_x86():
        return ["-march=native"]
    return [] if sys.platform == "darwin" else ["-mcpu=native"]  # Apple clang targets the host already


def compile_flags(arch: str) -> list[str]:
    # -ffp-contract=off: the compiler never fuses a*b+c on its own, so every scalar expression keeps
    # one rounding sequence in every loop it is inlined into; FMAs are explicit intrinsics.
    flags = ["-O3", *arch_flags(arch), "-ffp-contract=off", f"-DCONVEYOR_HEADERS={_headers_digest()}"]
    if sys.platform != "darwin":  # at::parallel_for is inline OpenMP on Linux builds of torch
        flags.append("-fopenmp")
    return flags


def _headers_digest() -> str:
    # torch re-builds when a source or a flag changes, but not a header: fold them into a flag.
    return hashlib.sha1(b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))).hexdigest()[:12]


def extension_name(kernel: str, arch: str) -> str:
    """One build directory per (kernel, arch, CPU, sources, checkout).

    The checkout's path is in the key because torch's build file names the source by path: two
    checkouts sharing one directory would rebuild it on every alternate start (and block on its lock).
    """
    slug = re.sub(r"[^A-Za-z0-9]+", "_", arch).strip("_") or "default"
    key = hashlib.sha1(" ".join(sorted(cpu_features())).encode())
    key.update(str(CSRC.resolve()).encode())
    key.update((CSRC / f"{kernel}.cpp").read_bytes())
    key.update(" ".join(compile_flags(arch)).encode())
    return f"conveyor_{kernel}_{slug}_{key.hexdigest()[:10]}"


@lru_cache(maxsize=16)
def required_features(arch: str, cxx: str = "c++") -> frozenset[str]:
    """CPU flags a binary built for `arch` may use (x86 only; from the compiler's predefined macros)."""
    if not is_x86():
        return frozenset()
    out = subprocess.run([cxx, *arch_flags(arch), "-dM", "-E", "-x", "c++", "/dev/null"],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(first_error(out.stderr) or f"{cxx} rejected -march={arch}")
    defined = {line.split()[1] for line in out.stdout.splitlines() if line.startswith("#define ")}
    return frozenset(flag for macro, flag in _X86_FEATURE_MACROS.items() if macro in defined)


def missing_features(arch: str) -> frozenset[str]:
    """Features `arch` needs that this CPU lacks (a library built so would die of SIGILL here)."""
    have = cpu_features()
    if not have:
        return frozenset()
    return required_features(arch) - have


def first_error(log: str) -> str | None:
    """The compiler's first error line from a build log (what a user needs to see first)."""
    lines = log.splitlines()
    for pattern in (r":\d+:\d+: (fatal )?error:", r"\berror\b"):  # gcc/clang's "file:line:col: error:" first
        for line in lines:
            if re.search(pattern, line, re.IGNORECASE) and not line.lstrip().startswith("["):
                return line.strip()[:500]
    lines = [line.strip() for line in lines if line.strip()]
    return lines[0][:500] if lines else None


@contextmanager
def _build_lock(name: str) -> Iterator[None]:
    """Serialize builds of one kernel across processes with an OS lock, which dies with its holder.

    torch's own build lock is a plain file: a process killed mid-build (Ctrl-C on a first start, a
    test run stopped) leaves it behind and every later start waits on it forever. Whoever holds our
    lock is the only conveyor process building this name, so a torch lock file it finds is stale.
    """
    try:
        import fcntl

        from torch.utils.cpp_extension import _get_build_directory

        build_dir = Path(_get_build_directory(name, verbose=False))
    except Exception:  # no fcntl (Windows) or a private torch helper moved: torch's lock alone
        yield
        return
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "conveyor.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing a kernel build lock left by a killed build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_kernel(kernel: str, arch: str) -> KernelBuild:
    """Build (or reuse) and import one kernel module for `arch`; never raises."""
    try:
        missing = missing_features(arch)
    except Exception as exc:  # no compiler at all
        return KernelBuild(kernel, None, f"no C++ compiler for -march={arch}: {exc}")
    if missing:
        return KernelBuild(kernel, None, f"-march={arch} needs CPU features this CPU lacks: "
                                         f"{', '.join(sorted(missing))}")
    name = extension_name(kernel, arch)
    try:
        from torch.utils.cpp_extension import load

        with _build_lock(name):
            module = load(name=name, sources=[str(CSRC / f"{kernel}.cpp")], extra_cflags=compile_flags(arch),
                          extra_include_paths=[str(CSRC)],
                          extra_ldflags=[] if sys.platform == "darwin" else ["-fopenmp"], verbose=False)
        return KernelBuild(kernel, module)
    except Exception as exc:  # compiler or ninja missing, or a compile error: the torch paths still work
        return KernelBuild(kernel, None, first_error(str(exc)) or type(exc).__name__)


# Compiler CPU seconds for all five kernels (README: about 3 min), for the first start's estimate.
ESTIMATED_BUILD_CPU_S = 180.0


def isa_level(features: frozenset[str]) -> str:
    """The kernels' fast path for these CPU flags, named as KernelBackend names it."""
    if {"amx_tile", "amx_bf16"} <= features:
        return "amx"
    if "avx512_bf16" in features:
        return "avx512_bf16"
    if "avx512f" in features:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= features else "generic"


def _build_directory(name: str) -> Path | None:
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name, verbose=False))
    except Exception:  # a private torch helper moved: no estimate, the build itself is unaffected
        return None


def _announce_build(arch: str) -> set[str]:
    """Log what a first start is waiting for (which level, about how long, where it is cached);
    returns the kernels not built yet."""
    pending = set()
    for kernel in KERNELS:
        directory = _build_directory(extension_name(kernel, arch))
        if directory is not None and not (directory / f"{extension_name(kernel, arch)}.so").exists():
            pending.add(kernel)
    if pending:
        try:
            level = isa_level(required_features(arch)) if is_x86() else "generic"
        except Exception:  # no compiler: load_kernel reports it
            return pending
        cpus = max(1, min(len(pending), os.cpu_count() or 1))
        seconds = ESTIMATED_BUILD_CPU_S * len(pending) / len(KERNELS) / cpus
        cache = _build_directory(extension_name(next(iter(pending)), arch))
        # NOTE: a warning so that every entry point shows it: a silent multi-minute start looks hung.
        logger.warning("compiling %d C++ kernel(s) for %s (-march=%s), about %.0f s on %d CPU(s), once: "
                       "cached in %s", len(pending), level, arch, seconds, cpus, cache.parent if cache else "?")
    return pending


@lru_cache(maxsize=8)
def load_kernels(arch: str = "native") -> dict[str, KernelBuild]:
    """Every kernel for `arch`, compiled concurrently (each build is one compiler process)."""
    pending = _announce_build(arch)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(KERNELS)) as pool:
        futures = {pool.submit(load_kernel, k, arch): k for k in KERNELS}
        for done, future in enumerate(as_completed(futures), 1):
            if futures[future] in pending:
                logger.info("kernel %s ready after %.0f s (%d/%d)", futures[future], time.perf_counter() - started,
                            done, len(KERNELS))
        builds = [future.result() for future in futures]
    for build in builds:
        if build.module is None:
            logger.warning("C++ kernel %r unavailable for -march=%s: %s", build.kernel, arch, build.error)
    return {b.kernel: b for b in builds}


def compile_check(arch: str, cxx: str = "c++", kernels: tuple[str, ...] = KERNELS) -> dict[str, str | None]:
    """Compile (no link, no load) every kernel for `arch` with `cxx`: the first error per kernel or None.

    Runs on any machine for any level the compiler targets (AMX on an AMD CPU, aarch64 with
    Debian's cross compiler), so a misplaced #if fails CI wherever CI lands.
    """
    from torch.utils.cpp_extension import include_paths

    includes = [*include_paths(), sysconfig.get_paths()["include"], str(CSRC)]
    flags = [f for f in compile_flags(arch) if f != "-O3"] + ["-O0", "-std=c++17", "-fPIC", "-w",
                                                              "-DTORCH_EXTENSION_NAME=conveyor_check"]

    def one(kernel: str) -> str | None:
        cmd = [cxx, *flags, *(f"-I{p}" for p in includes), "-c", str(CSRC / f"{kernel}.cpp"), "-o", "/dev/null"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        return None if out.returncode == 0 else (first_error(out.stderr) or f"{cxx} exited {out.returncode}")

    with ThreadPoolExecutor(max_workers=len(kernels)) as pool:
        return dict(zip(kernels, pool.map(one, kernels)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.kernels.build",
                                     description="Compile-check the C++ kernels for other ISA levels / targets.")
    parser.add_argument("--arch", action="append", required=True, help="-march value (repeatable)")
    parser.add_argument("--cxx", default="c++", help="compiler (e.g. aarch64-linux-gnu-g++)")
    args = parser.parse_args(argv)
    failed = False
    for arch in args.arch:
        started = time.perf_counter()
        errors = compile_check(arch, args.cxx)
        for kernel, error in errors.items():
            status = "ok" if error is None else f"FAILED: {error}"
            print(f"{args.cxx} -march={arch} {kernel}: {status}")
            failed |= error is not None
        print(f"  ({time.perf_counter() - started:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
