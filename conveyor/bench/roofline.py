"""A compute roofline for decode: how many tokens/s the matmul FLOPs of this machine allow."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

_PARAM_SUFFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


@dataclass(frozen=True)
class Roofline:
    gflops: float  # achievable matmul throughput
    gflops_per_token: float | None  # model forward FLOPs per token; None: no tok/s bound
    measured: bool = False  # gflops timed in this run rather than given

    @property
    def max_tok_s(self) -> float | None:
        return self.gflops / self.gflops_per_token if self.gflops_per_token else None

    def fraction(self, tok_s: float) -> float | None:
        bound = self.max_tok_s
        return tok_s / bound if bound else None


def parse_param_count(text: str) -> float:
    """'135M', '1.5B', '7e9' or '360000000' -> number of parameters."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    if not match:
        raise ValueError(f"cannot read a parameter count from {text!r} (try 135M or 1.5B)")
    return float(match.group(1)) * _PARAM_SUFFIXES[match.group(2)]


def gflops_per_token_from_params(num_params: float) -> float:
    # A forward pass does one multiply-add (2 FLOPs) per weight per token; attention is ignored.
    return 2.0 * num_params / 1e9


def measure_bf16_gemm_gflops(
    m: int = 32, k: int = 576, n: int = 1536, min_time_s: float = 0.5, device: str | None = None
) -> float:
    """Time a bf16 [m,k]x[k,n] GEMM (a batch-32 decode MLP of a SmolLM2-135M-sized model) and
    return the sustained GFLOP/s on `device` (CUDA when available, else CPU)."""
    import torch  # lazy: the bench itself needs no torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)

    def _sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for _ in range(3):  # warm-up: kernel selection, caches
        torch.matmul(a, b, out=out)
    _sync()
    num_iters, elapsed = 0, 0.0
    batch = 8
    start = time.perf_counter()
    while elapsed < min_time_s:
        for _ in range(batch):
            torch.matmul(a, b, out=out)
        _sync()
        num_iters += batch
        elapsed = time.perf_counter() - start
        batch *= 2  # fewer syncs as we learn how fast one GEMM is
    return 2.0 * m * k * n * num_iters / elapsed / 1e9
