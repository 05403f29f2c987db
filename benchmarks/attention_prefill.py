"""Paged attention per call, prefill and decode shapes: the amx build's tile path (csrc/paged_amx.h) against its
row path (CONVEYOR_PAGED_AMX=0), each in its own process, one thread, CPU time per call (median of reps).

  flock -x /tmp/bench.lock python benchmarks/attention_prefill.py          # both paths, a markdown table
  python benchmarks/attention_prefill.py --one                             # this process's path only
  python benchmarks/attention_prefill.py --one --save a.pt [--compare b.pt]  # A/B of two builds: bits equal?
  CONVEYOR_KERNEL_ARCH=x86-64-v3 python benchmarks/attention_prefill.py --one   # another level's build
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)
import torch

# (label, heads, kv heads, head dim, sequences, rows per sequence, context of each sequence's last row[, keys whose
# blocks every sequence shares])
CASES = [
    ("prefill 1B: 512 rows at 3.6-4k", 32, 8, 64, 1, 512, 4096),
    ("prefill 1B: 512 rows at 0-512", 32, 8, 64, 1, 512, 512),
    ("prefill 1B: 1480 rows at 0-1480", 32, 8, 64, 1, 1480, 1480),
    ("prefill 128-dim: 256 rows at 1.8-2k", 16, 2, 128, 1, 256, 2048),
    ("prefill 256-dim (Gemma 3): 256 rows at 1.8-2k", 8, 2, 256, 1, 256, 2048),
    ("decode 1B: 16 seqs at 2k", 32, 8, 64, 16, 1, 2048),
    ("decode 1B: 1 seq at 4k", 32, 8, 64, 1, 1, 4096),
    ("decode 128-dim: 8 seqs at 2k", 16, 2, 128, 8, 1, 2048),
    ("decode 256-dim: 8 seqs at 2k", 8, 2, 256, 8, 1, 2048),
    ("verify 1B: 16 seqs x 4 rows at 1k", 32, 8, 64, 16, 4, 1024),
    # Fan-out requests on one prompt (the prefix cache gives every sequence the same first blocks): 4,096 keys shared
    ("decode 1B: 16 seqs at 4.2k, 4k shared", 32, 8, 64, 16, 1, 4200, 4096),
    ("decode 128-dim (Qwen3 0.6B): 8 seqs at 2.1k, 2k shared", 16, 8, 128, 8, 1, 2100, 2048),
    ("decode 256-dim: 8 seqs at 2.1k, 2k shared", 8, 2, 256, 8, 1, 2100, 2048),
]


def run_cases(reps: int, outputs: dict | None = None) -> dict[str, float]:
    from conveyor.config import kernel_settings_from_env
    from conveyor.kernels import resolve_backend
    torch.set_num_threads(1)
    attention = resolve_backend(torch.device("cpu"), torch.bfloat16, kernel_settings_from_env(),
                                batch_invariant=True).attention
    times = {}
    for label, heads, kv_heads, dim, seqs, rows, ctx, *shared in CASES:
        blocks = -(-ctx // 16)
        gen = torch.Generator().manual_seed(heads + dim + ctx)
        kc = torch.randn(blocks * seqs, 16, kv_heads, dim, generator=gen).bfloat16()
        vc = torch.randn(blocks * seqs, 16, kv_heads, dim, generator=gen).bfloat16()
        tables = torch.tensor([[s * blocks + i for i in range(blocks)] for s in range(seqs)], dtype=torch.int32)
        if shared:  # every sequence's first shared[0] keys in sequence 0's blocks
            tables[:, :shared[0] // 16] = tables[0, :shared[0] // 16]
        seq = torch.tensor([s for s in range(seqs) for _ in range(rows)], dtype=torch.int32)
        pos = torch.tensor([ctx - rows + i for _ in range(seqs) for i in range(rows)], dtype=torch.int32)
        q = torch.randn(len(seq), heads, dim, generator=gen).bfloat16()
        call = lambda: attention.paged_attention(q, kc, vc, tables, seq, pos, dim ** -0.5, 0, 0.0, None)  # noqa: E731
        out = call()
        if outputs is not None:
            outputs[label] = out
        samples = []
        for _ in range(reps):
            start = time.process_time()
            call()
            samples.append(time.process_time() - start)
        times[label] = statistics.median(samples)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", action="store_true", help="time this process's path only (JSON)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--save", help="--one: save the outputs here (torch.save), for an A/B of two builds")
    parser.add_argument("--compare", help="--one: and say whether they are bitwise those saved here")
    args = parser.parse_args()
    if args.one:
        outputs: dict = {}
        print(json.dumps(run_cases(args.reps, outputs)))
        if args.save:
            torch.save(outputs, args.save)
        if args.compare:
            saved = torch.load(args.compare)
            print("bitwise equal:", all(torch.equal(saved[k], outputs[k]) for k in saved))
        return
    results = {}
    for name, env in (("rows", {"CONVEYOR_PAGED_AMX": "0"}), ("amx tiles", {})):
        out = subprocess.run([sys.executable, __file__, "--one", "--reps", str(args.reps)], check=True,
                             capture_output=True, text=True, env={**os.environ, **env})
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    print("| case | rows (ms) | amx tiles (ms) | speedup |\n|---|---|---|---|")
    for label, *_ in CASES:
        before, after = results["rows"][label] * 1e3, results["amx tiles"][label] * 1e3
        print(f"| {label} | {before:.1f} | {after:.1f} | {before / after:.2f}x |")


if __name__ == "__main__":
    main()
