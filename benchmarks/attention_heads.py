"""Attention kernel CPU time per call at head shapes off and on the register-blocked passes (one thread).

Decode rows: 16 sequences x 1 query row at 1,024 tokens of bf16 K/V each, so every row reads its own keys.
Usage: python benchmarks/attention_heads.py [--shapes 8x2x64,16x2x64,...] [--context 1024] [--rows 16]
"""

from __future__ import annotations

import argparse
import time

import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)
import torch

from conveyor.kernels import resolve_backend


def bench(attention, heads: int, kv_heads: int, head_dim: int, rows: int, context: int, block: int = 16,
          repeats: int = 5) -> float:
    """CPU seconds of one paged_attention call."""
    num_blocks = -(-context // block)
    kc = torch.randn(num_blocks * rows + 1, block, kv_heads, head_dim).bfloat16()
    vc = torch.randn_like(kc)
    tables = torch.tensor([[s * num_blocks + i for i in range(num_blocks)] for s in range(rows)], dtype=torch.int32)
    seq = torch.arange(rows, dtype=torch.int32)
    pos = torch.full((rows,), context - 1, dtype=torch.int32)
    q = torch.randn(rows, heads, head_dim).bfloat16()
    call = lambda: attention.paged_attention(q, kc, vc, tables, seq, pos, head_dim ** -0.5, 0, 0.0, None)
    call()
    started = time.process_time()
    for _ in range(repeats):
        call()
    return (time.process_time() - started) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="8x2x64,16x2x64,8x2x256,4x1x256,10x2x64",
                   help="heads x kv_heads x head_dim, comma-separated")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--rows", type=int, default=16)
    args = p.parse_args()
    torch.set_num_threads(1)
    attention = resolve_backend(torch.device("cpu"), torch.bfloat16, batch_invariant=True).attention
    print("| heads / KV heads / head dim | ms CPU per call | GMAC/s |\n|---|---|---|")
    for shape in args.shapes.split(","):
        heads, kv_heads, head_dim = (int(x) for x in shape.split("x"))
        seconds = bench(attention, heads, kv_heads, head_dim, args.rows, args.context)
        macs = args.rows * heads * args.context * head_dim * 2
        print(f"| {heads} / {kv_heads} / {head_dim} | {seconds * 1e3:.1f} | {macs / seconds / 1e9:.1f} |")


if __name__ == "__main__":
    main()
