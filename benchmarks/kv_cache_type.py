"""q8_0 vs bf16 KV cache (--cache-type-k / --cache-type-v): decode speed at long context and KV bytes per token.

Usage: python benchmarks/kv_cache_type.py --offline [--rows 16] [--context 2048] [--steps 24] [--out results.md]

--offline: a ~1B-shaped Llama (Llama 3.2 1B's layer shapes: hidden 2048, 16 layers, 32 heads / 8 KV heads of
64, intermediate 8192; SmolLM2's vocabulary) with random bf16 weights, through the engine. Each of --rows
sequences joins the batch with --context tokens of K/V already in the cache: they arrive through the KV
handoff import (engine/kv_transfer.py), so no 32k-token prefill is timed or waited for; the K/V are random
values in the cache's own format (attention costs the same for any values). Then --steps decode steps of all
rows are timed (median ms per step). Also: the attention kernel alone on one layer of that batch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.offline_throughput import emit_table, machine
from conveyor.config import EngineConfig
from conveyor.engine.engine import EngineCore
from conveyor.engine.kv_transfer import KVBlob
from conveyor.engine.sampling_params import SamplingParams
from conveyor.kernels.attention import AttentionMetadata
from conveyor.kernels.kv_quant import quantize_q8_0
from conveyor.loading import Checkpoint
from conveyor.models.config import ModelConfig
from conveyor.testing import smollm_tokenizer

SHAPE_1B = dict(architecture="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True)


def _drop(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)  # the model holds its own (packed) copy now


def random_llama(config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF-named random bf16 weights (scale 0.02), made directly in bf16 to keep peak memory at one copy."""
    gen = torch.Generator().manual_seed(0)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.bfloat16) * 0.02)

    weights = {"model.embed_tokens.weight": rand(config.vocab_size, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        weights.update({p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
                        p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
                        p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                        p + "mlp.down_proj.weight": rand(h, i)})
        weights.update({p + f"{norm}.weight": torch.ones(h, dtype=torch.bfloat16) for norm in config.layer_norm_names})
    return weights


def random_blob(core: EngineCore, num_tokens: int) -> KVBlob:
    """Random K/V for every attention layer in this engine's cache formats (the KVBlob layout)."""
    cfg = core.model_config
    gen = torch.Generator().manual_seed(1)
    parts = []
    for _ in range(cfg.num_attention_layers):
        for kind in (core.kv_types.k, core.kv_types.v):
            rows = torch.randn(num_tokens, cfg.num_key_value_heads, cfg.head_dim, generator=gen).to(core.dtype)
            parts.append((quantize_q8_0(rows) if kind == "q8_0" else rows).reshape(-1).view(torch.uint8))
    return KVBlob(cfg.num_attention_layers, num_tokens, cfg.num_key_value_heads, cfg.head_dim, "bfloat16",
                  torch.cat(parts).numpy().tobytes(), cache_type_k=core.kv_types.k, cache_type_v=core.kv_types.v)


def decode_ms_per_step(core: EngineCore, rows: int, context: int, steps: int) -> float:
    blob = random_blob(core, context)
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(rows):
        request = core.make_request([100 + (i * 7 + j) % 1000 for j in range(context)], params, f"r{i}")
        request.output_token_ids = [42]
        core.kv_transfer.stage_import(request, blob)
        core.add_request(request)
    del blob
    assert core.kv_transfer.stats.num_imported == rows, "every row must join with its K/V (pool too small?)"
    times = []
    while core.has_work():
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3  # the first steps warm caches up


def attention_ms(core: EngineCore, rows: int, context: int, repeats: int) -> float:
    """One layer's paged_attention for `rows` decode rows at `context` keys, each through its own blocks."""
    cfg, bs = core.model_config, core.kv.block_size
    key_cache, value_cache = core.runner.kv_layers()[0]
    per_row = -(-context // bs)
    tables = torch.arange(rows * per_row, dtype=torch.int32).reshape(rows, per_row)
    meta = AttentionMetadata(torch.zeros(rows, dtype=torch.long), tables, torch.arange(rows, dtype=torch.int32),
                             torch.full((rows,), context - 1, dtype=torch.int32), [context] * rows, [1] * rows)
    query = torch.randn(rows, cfg.num_attention_heads, cfg.head_dim).to(core.dtype)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        core.backend.paged_attention(query, key_cache, value_cache, meta, cfg.head_dim ** -0.5)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def offline(args: argparse.Namespace) -> None:
    tokenizer = smollm_tokenizer()
    config = ModelConfig(vocab_size=tokenizer.vocab_size, max_position_embeddings=args.context + 256,
                         rms_norm_eps=1e-5, eos_token_ids=tuple(tokenizer.eos_token_ids), **SHAPE_1B)
    results = {}
    for kind in args.types.split(","):
        checkpoint = Checkpoint(config=config, weights=random_llama(config), tokenizer=tokenizer, source="<random>",
                                name="random-llama-1b-shape", release_pages=_drop)
        core = EngineCore(EngineConfig(parallel=args.rows, ctx_size=args.rows * (args.context + 256),
                                       kv_cache_budget="none", speculative_ngram=0, cache_type_k=kind,
                                       cache_type_v=kind), checkpoint=checkpoint)
        del checkpoint
        per_token = core.pool_plan.bytes_per_block // core.kv.block_size
        ms = decode_ms_per_step(core, args.rows, args.context, args.steps)
        attn = attention_ms(core, args.rows, args.context, args.steps)
        results[kind] = (per_token, ms, attn)
        print(f"{kind}: {per_token} KV bytes/token, decode {ms:.1f} ms/step ({args.rows * 1e3 / ms:.1f} tok/s), "
              f"attention one layer {attn:.2f} ms", flush=True)
        del core
    base = results.get("bf16")
    rows = [[kind, f"{b:,} ({b / base[0]:.3f}x)" if base else f"{b:,}", f"{ms:.1f}",
             f"{args.rows * 1e3 / ms:.1f}" + (f" ({base[1] / ms:.2f}x)" if base else ""),
             f"{attn:.2f}" + (f" ({base[2] / attn:.2f}x)" if base else "")]
            for kind, (b, ms, attn) in results.items()]
    header = ["K and V cache type", "KV bytes per token", "decode ms/step", f"decode tok/s ({args.rows} rows)",
              "attention, one layer (ms)"]
    caption = (f"KV cache types: {args.rows} sequences decoding at {args.context} tokens of context, a ~1B-shaped "
               f"Llama (16 layers, 32/8 heads of 64, hidden 2048), random bf16 weights; median of {args.steps} "
               f"steps. Machine: {machine()}.")
    emit_table(caption, header, rows, args.out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--offline", action="store_true", help="through the engine in this process (the only mode)")
    p.add_argument("--types", default="bf16,q8_0", help="cache types to compare (K and V alike)")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--out", default=None, help="append the table to this markdown file")
    args = p.parse_args()
    if not args.offline:
        p.error("only --offline is implemented: run with --offline")
    offline(args)


if __name__ == "__main__":
    main()
