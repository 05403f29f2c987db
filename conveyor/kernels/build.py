"""Compiling and loading our C++ CPU kernels: one extension module per kernel, per ISA level.

Each kernel (gemm, attention, fused_ops, qgemm, recurrent) is its own module, so a compiler problem in one
costs only that one (and is reported), never the others. `arch` is the `-march` value
(CONVEYOR_KERNEL_ARCH, default native): one machine can build, test and compile-check every
level. Builds are cached under torch.utils.cpp_extension's root (~/.cache/torch_extensions/py3X_cpu
or $TORCH_EXTENSIONS_DIR) by a name keyed by the sources, flags, torch and this CPU's feature flags,
never by a checkout's or a virtualenv's path: every checkout and venv with the same torch on this
CPU shares one build (`make setup` makes it, `python -m conveyor.kernels --build`). A home directory
shared between machines never hands a CPU a library it cannot run; a level the CPU lacks is refused
before loading. Compile-only checks of other levels live in checks.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import platform
import re
import subprocess
import sys
import sysconfig
import tempfile
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
BUILT_MARKER = "conveyor-built.json"  # written into a build directory once its library is complete
CACHE_NAME = "conveyor-cache"  # beside the builds: measured build times, compile-check results

# Compiler macro -> the CPU flag (/proc/cpuinfo spelling) a binary built with it needs.
X86_FEATURE_MACROS = {
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
    compiled: bool = False  # compiled by this call (False: imported from the cache, or failed)


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
    flags = ["-O3", *arch_flags(arch), "-ffp-contract=off"]
    if sys.platform != "darwin":  # at::parallel_for is inline OpenMP on Linux builds of torch
        flags.append("-fopenmp")
    return flags


def kernel_sources(kernel: str) -> list[Path]:
    """What one kernel's build reads from csrc: its .cpp and every header (any of them may be included)."""
    return [CSRC / f"{kernel}.cpp", *sorted(CSRC.glob("*.h"))]


def sources_digest(paths: list[Path]) -> str:
    """The files' names and contents, never their location."""
    digest = hashlib.sha1()
    for path in paths:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@lru_cache(maxsize=1)
def torch_build_id() -> str:
    """The torch a library links against and compiles with the headers of (version, commit)."""
    import torch

    return f"{torch.__version__} {getattr(torch.version, 'git_version', '')}"


def extension_name(kernel: str, arch: str) -> str:
    """One build per (kernel, arch, CPU flags, sources + headers, flags, torch, Python ABI).

    No path is in the key, so every checkout and virtualenv with the same torch shares the build:
    it compiles a copy of the sources kept in its own directory, and a finished build is imported
    directly (BUILT_MARKER), never re-checked by torch, whose build file names one venv's headers.
    """
    slug = re.sub(r"[^A-Za-z0-9]+", "_", arch).strip("_") or "default"
    key = hashlib.sha1()
    for part in (" ".join(sorted(cpu_features())), torch_build_id(), sysconfig.get_config_var("EXT_SUFFIX") or "",
                 " ".join(compile_flags(arch)), sources_digest(kernel_sources(kernel))):
        key.update(part.encode() + b"\0")
    return f"conveyor_{kernel}_{slug}_{key.hexdigest()[:10]}"


def cache_directory(name: str) -> Path:
    """`name`'s directory (created) under torch's extension root: $TORCH_EXTENSIONS_DIR, else
    ~/.cache/torch_extensions/py3X_cpu."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name, verbose=False))
    except (ImportError, AttributeError):  # the private torch helper moved: its documented default
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                      "torch_extensions")
        path = Path(root) / name
        path.mkdir(parents=True, exist_ok=True)
        return path


@lru_cache(maxsize=32)
def predefined_macros(arch: str, cxx: str = "c++") -> dict[str, str]:
    """The compiler's predefined macros for `arch` (name -> value), as `cxx -dM -E` lists them."""
    out = subprocess.run([cxx, *arch_flags(arch), "-dM", "-E", "-x", "c++", "/dev/null"],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(first_error(out.stderr) or f"{cxx} rejected -march={arch}")
    macros = {}
    for line in out.stdout.splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) >= 2 and parts[0] == "#define":
            macros[parts[1]] = parts[2] if len(parts) == 3 else ""
    return macros


@lru_cache(maxsize=16)
def required_features(arch: str, cxx: str = "c++") -> frozenset[str]:
    """CPU flags a binary built for `arch` may use (x86 only; from the compiler's predefined macros)."""
    if not is_x86():
        return frozenset()
    defined = predefined_macros(arch, cxx)
    return frozenset(flag for macro, flag in X86_FEATURE_MACROS.items() if macro in defined)


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
    except ImportError:  # Windows: torch's lock alone
        yield
        return
    build_dir = cache_directory(name)
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
    """Import one kernel module for `arch` from the cache, building it there first if needed; never raises."""
    try:
        missing = missing_features(arch)
    except Exception as exc:  # no compiler at all
        return KernelBuild(kernel, None, f"no C++ compiler for -march={arch}: {exc}")
    if missing:
        return KernelBuild(kernel, None, f"-march={arch} needs CPU features this CPU lacks: "
                                         f"{', '.join(sorted(missing))}")
    try:
        name = extension_name(kernel, arch)
        directory = cache_directory(name)
        module = _import_built(name, directory)
        if module is not None:
            return KernelBuild(kernel, module)
        with _build_lock(name):
            module = _import_built(name, directory)  # another process may have built it meanwhile
            if module is not None:
                return KernelBuild(kernel, module)
            return KernelBuild(kernel, _compile(kernel, arch, name, directory), compiled=True)
    except Exception as exc:  # compiler or ninja missing, or a compile error: the torch paths still work
        return KernelBuild(kernel, None, first_error(str(exc)) or type(exc).__name__)


def _import_built(name: str, directory: Path) -> ModuleType | None:
    """A finished build's module, imported without a compiler or torch's build file; None if unbuilt."""
    if name in sys.modules:
        return sys.modules[name]
    library = directory / f"{name}{'.pyd' if sys.platform == 'win32' else '.so'}"
    if not ((directory / BUILT_MARKER).exists() and library.exists()):
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _compile(kernel: str, arch: str, name: str, directory: Path) -> ModuleType:
    """Build `kernel` in `directory` from a copy of its sources kept there (no checkout path in the build)."""
    from torch.utils.cpp_extension import load

    src = directory / "src"
    src.mkdir(exist_ok=True)
    for path in kernel_sources(kernel):
        data, copy = path.read_bytes(), src / path.name
        if not copy.exists() or copy.read_bytes() != data:  # the name fixes the content: only a killed copy differs
            write_atomically(copy, data)
    started = time.perf_counter()
    module = load(name=name, sources=[str(src / f"{kernel}.cpp")], extra_cflags=compile_flags(arch),
                  extra_include_paths=[str(src)], build_directory=str(directory),
                  extra_ldflags=[] if sys.platform == "darwin" else ["-fopenmp"], verbose=False)
    record = {"kernel": kernel, "arch": arch, "torch": torch_build_id(), "wall_s": round(time.perf_counter() - started, 1)}
    write_atomically(directory / BUILT_MARKER, json.dumps(record).encode())
    sys.modules[name] = module
    return module


def write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


# Compiler CPU seconds for all five kernels (README: about 3 min), for the first start's estimate
# until a build on this machine has been measured (build_times()).
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


def _build_times_path() -> Path:
    return cache_directory(CACHE_NAME) / "build-times.json"


def build_times() -> dict[str, dict]:
    """Kernel builds measured on this machine, per arch: compiler CPU seconds per kernel, wall seconds."""
    try:
        return json.loads(_build_times_path().read_text())
    except (OSError, ValueError):
        return {}


def _record_build_time(arch: str, kernels: int, cpu_s: float, wall_s: float) -> None:
    times = build_times()
    times[arch] = {"cpu_s_per_kernel": round(cpu_s / kernels, 1), "kernels": kernels, "wall_s": round(wall_s, 1),
                   "cpus": os.cpu_count(), "cpu": cpu_model()}
    try:
        write_atomically(_build_times_path(), json.dumps(times, indent=1).encode())
    except OSError as exc:  # a read-only cache still builds; the next estimate is the constant's
        logger.info("could not record the kernel build time: %s", exc)


def _children_cpu_s() -> float | None:
    """CPU seconds of this process's finished children (the compilers, under ninja)."""
    try:
        import resource
    except ImportError:  # Windows: nothing measured, the estimate stays the constant's
        return None
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def estimated_cpu_s_per_kernel(arch: str) -> tuple[float, str]:
    """Compiler CPU seconds per kernel: the last build of `arch` measured on this CPU, else the constant's share."""
    recorded = build_times().get(arch, {})
    if recorded.get("cpu") == cpu_model() and recorded.get("cpu_s_per_kernel", 0) > 0:
        return float(recorded["cpu_s_per_kernel"]), "measured here"
    return ESTIMATED_BUILD_CPU_S / len(KERNELS), "estimated"


def _announce_build(arch: str) -> set[str]:
    """Log what a first start is waiting for (which level, about how long, where it is cached);
    returns the kernels not built yet."""
    pending = set()
    for kernel in KERNELS:
        name = extension_name(kernel, arch)
        if not (cache_directory(name) / BUILT_MARKER).exists():
            pending.add(kernel)
    if pending:
        try:
            level = isa_level(required_features(arch)) if is_x86() else "generic"
        except Exception:  # no compiler: load_kernel reports it
            return pending
        cpus = max(1, min(len(pending), os.cpu_count() or 1))
        per_kernel, source = estimated_cpu_s_per_kernel(arch)
        cache = cache_directory(extension_name(next(iter(pending)), arch)).parent
        # NOTE: a warning so that every entry point shows it: a silent multi-minute start looks hung.
        logger.warning("compiling %d C++ kernel(s) for %s (-march=%s), about %.0f s on %d CPU(s) (%s), once: "
                       "cached in %s", len(pending), level, arch, per_kernel * len(pending) / cpus, cpus, source,
                       cache)
    return pending


@lru_cache(maxsize=8)
def load_kernels(arch: str = "native") -> dict[str, KernelBuild]:
    """Every kernel for `arch`, compiled concurrently where not cached (each build is one compiler process)."""
    pending = _announce_build(arch)
    started, cpu_started = time.perf_counter(), _children_cpu_s()
    with ThreadPoolExecutor(max_workers=len(KERNELS)) as pool:
        futures = {pool.submit(load_kernel, k, arch): k for k in KERNELS}
        for done, future in enumerate(as_completed(futures), 1):
            if futures[future] in pending:
                logger.info("kernel %s ready after %.0f s (%d/%d)", futures[future], time.perf_counter() - started,
                            done, len(KERNELS))
        builds = [future.result() for future in futures]
    compiled, cpu_now = [b for b in builds if b.compiled], _children_cpu_s()
    # NOTE: recorded only when every pending kernel was compiled here: one another process built adds no CPU.
    if compiled and len(compiled) == len(pending) and cpu_started is not None and cpu_now is not None:
        _record_build_time(arch, len(compiled), cpu_now - cpu_started, time.perf_counter() - started)
    for build in builds:
        if build.module is None:
            logger.warning("C++ kernel %r unavailable for -march=%s: %s", build.kernel, arch, build.error)
    share_pool([b.module for b in builds if b.module is not None])
    return {b.kernel: b for b in builds}


def share_pool(modules: list) -> None:
    """Run every module's parallel loops on the first one's thread pool (csrc/parallel.h, def_pool_sharing):
    one set of helper threads for a step's kernels instead of one per module. Modules of another compiler
    or pool layout (pool_abi) keep their own."""
    sharing = [m for m in modules if hasattr(m, "pool_handle")]
    if len(sharing) < 2:
        return
    owner = sharing[0]
    for module in sharing[1:]:
        if module.pool_abi() == owner.pool_abi():
            module.adopt_pool(owner.pool_handle())
