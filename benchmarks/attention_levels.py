"""Our CPU kernels at one ISA level against the torch paths they replace, at SmolLM2-135M's shapes.

The level is the one CONVEYOR_KERNEL_ARCH selects (read by conveyor.config.kernel_settings_from_env()),
so the same script measures every level this machine runs:

    CONVEYOR_KERNEL_ARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 python benchmarks/attention_levels.py
    CONVEYOR_KERNEL_ARCH=native python benchmarks/attention_levels.py

(ATEN_CPU_CAPABILITY=avx2 caps torch at AVX2 too, as on an AVX2 laptop.) Rows:
- decode attention, one layer: 32 rows, each its own sequence of ~135 keys (9 heads, 3 KV heads,
  head dim 64, block size 16, block tables shuffled over the pool). Each call takes the next of
  --layers layers' caches, so K/V come from memory as they do in a 30-layer step, not from L2;
- prefill attention: one 2048-token prompt in one call (causal);
- rms_norm, add_rms_norm, silu_mul, rope_write_kv at 16 rows (hidden 576, intermediate 1536),
against reference_paged_attention and the torch op chains (the backend with kernels disabled).
Each entry is the median over --repeats timed blocks (the machine may be shared), after warm-up.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Callable

import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)
import torch

from conveyor.config import kernel_settings_from_env
from conveyor.kernels import AttentionMetadata, KernelSettings, cpu_backend, resolve_backend
from conveyor.kernels.attention import write_kv
from conveyor.models.layers import RotaryEmbedding
from offline_throughput import emit_table, machine

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16  # SmolLM2-135M
HIDDEN, INTERMEDIATE, EPS = 576, 1536, 1e-5


def time_call(fn: Callable[[], object], repeats: int, block_s: float = 0.02) -> float:
    """Median seconds per call over `repeats` blocks of calls (each block at least ~block_s)."""
    for _ in range(3):
        fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(1, int(block_s / once))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def paged_caches(num_layers: int, num_blocks: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return [(torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16())
            for _ in range(num_layers)]


def metadata(seq_lens: list[int], rows_per_seq: list[int], num_blocks: int, seed: int) -> AttentionMetadata:
    """Sequence i owns blocks drawn at random from the pool; its last rows_per_seq[i] tokens query."""
    blocks = list(range(num_blocks))
    random.Random(seed).shuffle(blocks)
    max_blocks = max((n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in seq_lens)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    token_seq, token_pos = [], []
    for i, (n, r) in enumerate(zip(seq_lens, rows_per_seq)):
        need = (n + BLOCK_SIZE - 1) // BLOCK_SIZE
        tables[i, :need] = torch.tensor([blocks.pop() for _ in range(need)], dtype=torch.int32)
        token_seq += [i] * r
        token_pos += list(range(n - r, n))
    return AttentionMetadata(slot_mapping=torch.zeros(len(token_seq), dtype=torch.long), block_tables=tables,
                             token_seq=torch.tensor(token_seq, dtype=torch.int32),
                             token_pos=torch.tensor(token_pos, dtype=torch.int32),
                             seq_lens=list(seq_lens), seq_token_counts=list(rows_per_seq))


def cycling(fn: Callable[[int], object], count: int) -> Callable[[], object]:
    """A call that takes the next of `count` layers each time."""
    state = {"i": 0}

    def call() -> object:
        state["i"] = (state["i"] + 1) % count
        return fn(state["i"])

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15, help="timed blocks per entry (median reported)")
    parser.add_argument("--layers", type=int, default=16, help="decode: layers' caches cycled through")
    parser.add_argument("--decode-rows", type=int, default=32)
    parser.add_argument("--decode-keys", type=int, default=135)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="append the markdown table to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]

    ours = cpu_backend(kernel_settings_from_env())
    if ours.attention is None or ours.fused is None:
        raise SystemExit(f"kernels unavailable at CONVEYOR_KERNEL_ARCH={ours.arch}: {ours.errors}")
    ref = resolve_backend("cpu", settings=KernelSettings(disable=True))
    level = ours.attention.isa()
    gen = torch.Generator().manual_seed(0)
    rows: list[list[str]] = []

    def entry(name: str, shape: str, mine: Callable[[], object], theirs: Callable[[], object], repeats: int) -> None:
        t_ours, t_ref = time_call(mine, repeats), time_call(theirs, repeats)
        rows.append([name, shape, f"{t_ours * 1e6:,.1f}", f"{t_ref * 1e6:,.1f}", f"{t_ref / t_ours:.2f}x"])
        print(f"  {name}: {t_ours * 1e6:,.1f} us vs torch {t_ref * 1e6:,.1f} us", flush=True)

    # Decode: 32 sequences of ~135 keys (130..140), one query row each.
    lens = [args.decode_keys - 5 + (i % 11) for i in range(args.decode_rows)]
    need = sum((n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in lens)
    pool = 2 * need
    caches = paged_caches(args.layers, pool, gen)
    metas = [metadata(lens, [1] * len(lens), pool, seed=layer) for layer in range(args.layers)]
    query = torch.randn(args.decode_rows, HEADS, HEAD_DIM, generator=gen).bfloat16()
    scale = HEAD_DIM ** -0.5
    entry("decode attention (1 layer)", f"{args.decode_rows} rows x ~{args.decode_keys} keys, 9/3 heads, d 64",
          cycling(lambda i: ours.paged_attention(query, *caches[i], metas[i], scale), args.layers),
          cycling(lambda i: ref.paged_attention(query, *caches[i], metas[i], scale), args.layers), args.repeats)

    # Prefill: one prompt of 2048 tokens, all rows in one call.
    n = args.prefill_tokens
    pool = (n + BLOCK_SIZE - 1) // BLOCK_SIZE + 8
    kc, vc = paged_caches(1, pool, gen)[0]
    meta = metadata([n], [n], pool, seed=99)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen).bfloat16()
    entry("prefill attention", f"{n} tokens, causal", lambda: ours.paged_attention(q, kc, vc, meta, scale),
          lambda: ref.paged_attention(q, kc, vc, meta, scale), max(3, args.repeats // 3))

    # The fused ops at a 16-row decode batch.
    t = 16
    x = torch.randn(t, HIDDEN, generator=gen).bfloat16()
    delta = torch.randn(t, HIDDEN, generator=gen).bfloat16()
    weight = torch.randn(HIDDEN, generator=gen).bfloat16()
    entry("rms_norm", f"{t} x {HIDDEN}", lambda: ours.rms_norm(x, weight, EPS), lambda: ref.rms_norm(x, weight, EPS),
          args.repeats)
    entry("add_rms_norm", f"{t} x {HIDDEN}", lambda: ours.add_rms_norm(x, delta, weight, EPS),
          lambda: ref.add_rms_norm(x, delta, weight, EPS), args.repeats)
    gate_up = torch.randn(t, 2 * INTERMEDIATE, generator=gen).bfloat16()
    entry("silu_mul", f"{t} x 2*{INTERMEDIATE}", lambda: ours.silu_mul(gate_up), lambda: ref.silu_mul(gate_up),
          args.repeats)

    qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).bfloat16()
    rotary = RotaryEmbedding(HEAD_DIM, 4096, 10000.0, None)
    cos, ssin = rotary.tables(torch.arange(100, 100 + t), torch.bfloat16)
    cos2, ssin2 = cos.squeeze(1).contiguous(), ssin.squeeze(1).contiguous()
    kcache, vcache = paged_caches(1, 64, gen)[0]
    slots = torch.tensor(random.Random(5).sample(range(64 * BLOCK_SIZE), t), dtype=torch.long)

    def rope_torch() -> torch.Tensor:  # the model's unfused chain (LlamaAttention without fuses_rope)
        qk, v = qkv.split([(HEADS + KV_HEADS) * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        qk = RotaryEmbedding.apply(qk.view(t, HEADS + KV_HEADS, HEAD_DIM), cos, ssin)
        q_rot, k = qk.split([HEADS, KV_HEADS], dim=1)
        write_kv(kcache, vcache, k, v.view(t, KV_HEADS, HEAD_DIM), slots)
        return q_rot

    entry("rope_write_kv", f"{t} rows, 9+3+3 heads x 64",
          lambda: ours.rope_write_kv(qkv, cos2, ssin2, kcache, vcache, slots, HEADS), rope_torch, args.repeats)

    cap = os.environ.get("ATEN_CPU_CAPABILITY")
    capped = f", ATEN_CPU_CAPABILITY={cap}" if cap else ""
    caption = (f"Kernels at CONVEYOR_KERNEL_ARCH={ours.arch} (compiled level {level}) vs torch "
               f"(capability {torch.backends.cpu.get_cpu_capability()}{capped}); "
               f"medians of {args.repeats} blocks, microseconds per call. {machine()}; load average "
               f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after (above the thread count, a parallel "
               f"region waits for a descheduled thread and times jump).")
    emit_table(caption, ["op", "shape", f"conveyor {level} (us)", "torch (us)", "speedup"], rows, args.out)


if __name__ == "__main__":
    main()
