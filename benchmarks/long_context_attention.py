"""Decode attention deep in one long context, the kernels alone: one decode row at --context keys through --layers
layers' own K/V caches (so every step streams its caches from memory, as a real decode step does), per cache type,
wall time per step and the bytes it read per second. The 1B's shape by default (32 query heads, 8 KV heads of 64).

  flock -x /tmp/bench.lock python benchmarks/long_context_attention.py [--types bf16,q8_0] [--threads 2] \
      [--context 16384] [--layers 16]
"""
from __future__ import annotations

import argparse
import statistics
import time

import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)
import torch

from quantized import machine  # a sibling script


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", default="bf16,q8_0", help="K and V cache types (each kept alike)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", default="32,8,64", help="query heads, KV heads, head dim")
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    from conveyor.config import kernel_settings_from_env
    from conveyor.kernels import resolve_backend
    from conveyor.kernels.kv_quant import quantize_q8_0

    torch.set_num_threads(args.threads)
    attention = resolve_backend(torch.device("cpu"), torch.bfloat16, kernel_settings_from_env(),
                                batch_invariant=True).attention
    heads, kv_heads, dim = (int(x) for x in args.heads.split(","))
    blocks = -(-args.context // 16)
    gen = torch.Generator().manual_seed(0)
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    seq, pos = torch.zeros(1, dtype=torch.int32), torch.tensor([args.context - 1], dtype=torch.int32)
    query = torch.randn(1, heads, dim, generator=gen).bfloat16()
    print(f"{machine()}; {args.threads} threads; one decode row at {args.context} keys, {args.layers} layers' own "
          f"caches, heads {heads}/{kv_heads} of {dim}; median of {args.steps} steps")
    print("| cache type | ms per step | MB read per step | GB/s |\n|---|---|---|---|")
    for kind in args.types.split(","):
        caches = []
        for _ in range(args.layers):
            k = torch.randn(blocks, 16, kv_heads, dim, generator=gen).bfloat16()
            v = torch.randn(blocks, 16, kv_heads, dim, generator=gen).bfloat16()
            caches.append((k, v) if kind == "bf16" else (quantize_q8_0(k).contiguous(), quantize_q8_0(v).contiguous()))

        def step() -> None:
            for k, v in caches:
                attention.paged_attention(query, k, v, tables, seq, pos, dim ** -0.5, 0, 0.0, None)

        step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        read = sum(t.numel() * t.element_size() for pair in caches for t in pair)
        print(f"| {kind} | {seconds * 1e3:.2f} | {read / 1e6:.0f} | {read / seconds / 1e9:.1f} |", flush=True)
        del caches


if __name__ == "__main__":
    main()
