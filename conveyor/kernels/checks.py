"""The kernels' other builds, checked without running them (scripts/kernel-levels.sh, CI).

- `same_build_as_native(arch)`: whether `-march=arch` compiles the same kernel code as native here
  (the predefined macros the sources branch on agree), so testing that level again proves nothing new;
- `compile_checks(targets)`: compile (no link, no load) every kernel for levels or targets this CPU
  cannot run (AMX on an AMD CPU, aarch64 with Debian's cross compiler), all at once on a pool, each
  success cached by a hash of what the compile reads, so an unchanged tree skips them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from conveyor.kernels.build import (CACHE_NAME, CSRC, KERNELS, X86_FEATURE_MACROS, write_atomically, cache_directory,
                                    compile_flags, first_error, kernel_sources, predefined_macros, sources_digest,
                                    torch_build_id)

# A preprocessor line's identifiers that a compiler predefines: __AVX2__, __aarch64__, __ARM_NEON...
_DIRECTIVE = re.compile(r"^\s*#\s*(?:if|ifdef|ifndef|elif)\b(.*)$", re.MULTILINE)
_PREDEFINED = re.compile(r"\b(__[A-Za-z0-9_]+)\b")


def kernel_macros(csrc: Path = CSRC) -> frozenset[str]:
    """The predefined macros the kernel sources branch on (#if/#ifdef/#elif lines), plus every ISA
    macro build.py maps to a CPU flag (torch's headers may branch on those)."""
    found = set(X86_FEATURE_MACROS)
    for path in sorted(csrc.glob("*.cpp")) + sorted(csrc.glob("*.h")):
        for directive in _DIRECTIVE.findall(path.read_text()):
            found.update(_PREDEFINED.findall(directive.split("//")[0]))
    return frozenset(found)


def macro_differences(arch: str, other: str = "native", cxx: str = "c++") -> dict[str, tuple[str | None, str | None]]:
    """Macro -> (value for arch, value for other), for each macro the kernels branch on that differs."""
    a, b = predefined_macros(arch, cxx), predefined_macros(other, cxx)
    return {m: (a.get(m), b.get(m)) for m in sorted(kernel_macros()) if a.get(m) != b.get(m)}


def same_build_as_native(arch: str, cxx: str = "c++") -> bool:
    """Whether `-march=arch` compiles the very kernel code native does on this CPU.

    Only the tuning may differ then (-march=native also picks -mtune and ISA extensions no #if
    reads), and without -ffast-math the compiler may not reorder float arithmetic, so the results
    are the same bits: re-running a level's tests there checks nothing the native run did not.
    """
    return not macro_differences(arch, "native", cxx)


@dataclass(frozen=True)
class CheckResult:
    cxx: str
    arch: str
    kernel: str
    error: str | None  # the compiler's first error, or None
    cached: bool  # skipped: the same compile succeeded before
    seconds: float


@lru_cache(maxsize=8)
def compiler_id(cxx: str) -> str:
    """The compiler's version and target, as it reports them (a new compiler re-checks everything)."""
    parts = []
    for flag in ("--version", "-dumpmachine"):
        out = subprocess.run([cxx, flag], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(first_error(out.stderr) or f"{cxx} {flag} exited {out.returncode}")
        parts.append(out.stdout.strip().splitlines()[0] if out.stdout.strip() else "")
    return " | ".join(parts)


def check_flags(arch: str) -> list[str]:
    return [f for f in compile_flags(arch) if f != "-O3"] + ["-O0", "-std=c++17", "-fPIC", "-w",
                                                             "-DTORCH_EXTENSION_NAME=conveyor_check"]


def compile_check_key(kernel: str, arch: str, cxx: str) -> str:
    """A hash of everything one compile check reads: sources + headers, flags, compiler (name, version), arch, torch."""
    key = hashlib.sha1()
    for part in (kernel, arch, cxx, compiler_id(cxx), " ".join(check_flags(arch)), torch_build_id(),
                 sysconfig.get_config_var("py_version_nodot") or "", sources_digest(kernel_sources(kernel))):
        key.update(part.encode() + b"\0")
    return key.hexdigest()


def _check_cache() -> Path:
    path = cache_directory(CACHE_NAME) / "compile-checks"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _compile_one(cxx: str, arch: str, kernel: str, use_cache: bool) -> CheckResult:
    started = time.perf_counter()
    try:
        marker = _check_cache() / f"{compile_check_key(kernel, arch, cxx)}.ok"
    except Exception as exc:  # no such compiler
        return CheckResult(cxx, arch, kernel, f"{cxx}: {exc}", False, 0.0)
    if use_cache and marker.exists():
        return CheckResult(cxx, arch, kernel, None, True, 0.0)
    from torch.utils.cpp_extension import include_paths

    includes = [*include_paths(), sysconfig.get_paths()["include"], str(CSRC)]
    cmd = [cxx, *check_flags(arch), *(f"-I{p}" for p in includes), "-c", str(CSRC / f"{kernel}.cpp"), "-o", os.devnull]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - started
    if out.returncode != 0:
        return CheckResult(cxx, arch, kernel, first_error(out.stderr) or f"{cxx} exited {out.returncode}", False,
                           seconds)
    write_atomically(marker, json.dumps({"cxx": cxx, "arch": arch, "kernel": kernel,
                                          "seconds": round(seconds, 1)}).encode())
    return CheckResult(cxx, arch, kernel, None, False, seconds)


def compile_checks(targets: list[tuple[str, str]], kernels: tuple[str, ...] = KERNELS, jobs: int | None = None,
                   use_cache: bool = True) -> list[CheckResult]:
    """Compile-check every kernel for every (compiler, arch) target on one pool of `jobs` compilers
    (default: one per CPU; each takes ~1 GB at -O0 with torch's headers)."""
    work = [(cxx, arch, kernel) for cxx, arch in targets for kernel in kernels]
    with ThreadPoolExecutor(max_workers=max(1, jobs or os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda job: _compile_one(*job, use_cache), work))


def compile_check(arch: str, cxx: str = "c++", kernels: tuple[str, ...] = KERNELS) -> dict[str, str | None]:
    """One target's kernels: the first error per kernel or None (cached successes count)."""
    return {r.kernel: r.error for r in compile_checks([(cxx, arch)], kernels)}
