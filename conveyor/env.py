"""`conveyor env`: what this machine gives conveyor (in the spirit of torch's collect_env).

The kernel backend and why (the compiler's first error when a kernel did not build), the torch
build, the CPU and the flags that pick a kernel level, threads. Paste it into a bug report.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import torch

from conveyor.config import EngineConfig
from conveyor.kernels import resolve_backend
from conveyor.kernels.build import cpu_features, cpu_model, missing_features
from conveyor.kernels.quant_ref import NATIVE_TYPES, type_name

# The flags that decide which kernel level can run (x86 and Arm spellings).
_RELEVANT_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                   "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "fphp", "asimdhp", "bf16", "sve",
                   "i8mm")


def _compiler_version() -> str:
    try:
        out = subprocess.run(["c++", "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else "c++ not usable"
    except (OSError, subprocess.SubprocessError):
        return "no c++ compiler found"


def collect(config: EngineConfig) -> dict:
    """Everything `conveyor env` prints, as one dict (building the kernels if needed)."""
    settings = config.kernel_settings
    backend = resolve_backend("cpu", torch.bfloat16, settings, config.batch_invariant)
    flags = cpu_features()
    try:
        missing = sorted(missing_features(settings.arch))
    except Exception as exc:  # no compiler
        missing = [f"unknown ({exc})"]
    return {
        "conveyor": backend.describe(),
        # GGUF tensors of these types stay quantized (--weight-dtype auto); others are dequantized at load.
        "quantized_weight_types": [type_name(t) for t in sorted(NATIVE_TYPES) if backend.runs_quantized(t)],
        "quantized_kernel": backend.qgemm.backend() if backend.qgemm is not None else None,
        # AVX2's decode walks pick their weight-stream prefetch by CPU vendor (docs/kernels.md).
        "quantized_decode_prefetch": backend.qgemm.decode_prefetch() if backend.qgemm is not None else None,
        "kernel_arch": settings.arch,
        "arch_needs_missing_cpu_features": missing,
        "cpu": {"model": cpu_model(), "machine": platform.machine(),
                "flags": [f for f in _RELEVANT_FLAGS if f in flags]},
        "torch": {"version": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                  "mkldnn": torch.backends.mkldnn.is_available(), "openmp": torch.backends.openmp.is_available(),
                  "cuda": torch.cuda.is_available(),
                  "mps": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()),
                  "threads": torch.get_num_threads()},
        "compiler": _compiler_version(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def render(info: dict) -> str:
    kernels = info["conveyor"]
    lines = [
        f"backend           {kernels['backend']} (arch {info['kernel_arch']})",
        f"batch invariant   {kernels['batch_invariant']}",
        f"speculation       {kernels['speculation']}",
    ]
    for name, level in kernels["kernels"].items():
        status = level if level is not None else f"MISSING: {kernels['errors'].get(name)}"
        lines.append(f"  kernel {name:<10} {status}")
    quantized = info["quantized_weight_types"]
    lines.append("quantized weights " + (f"{' '.join(quantized)} kept quantized (kernel {info['quantized_kernel']}, "
                                         f"decode prefetch {info['quantized_decode_prefetch']})"
                                         if quantized else "none kept: GGUF blocks are dequantized at load"))
    if info["arch_needs_missing_cpu_features"]:
        lines.append(f"  -march={info['kernel_arch']} needs: {', '.join(info['arch_needs_missing_cpu_features'])}")
    torch_info = info["torch"]
    lines += [
        f"cpu               {info['cpu']['model']} ({info['cpu']['machine']})",
        f"cpu flags         {' '.join(info['cpu']['flags']) or '(unknown)'}",
        f"torch             {torch_info['version']} (cpu capability {torch_info['cpu_capability']}, "
        f"mkldnn {torch_info['mkldnn']}, openmp {torch_info['openmp']}, cuda {torch_info['cuda']}, "
        f"mps {torch_info['mps']})",
        f"threads           {torch_info['threads']}",
        f"compiler          {info['compiler']}",
        f"python            {info['python']} on {info['platform']}",
    ]
    return "\n".join(lines)


def main(config: EngineConfig, as_json: bool = False) -> int:
    info = collect(config)
    print(json.dumps(info, indent=2) if as_json else render(info))
    return 0
