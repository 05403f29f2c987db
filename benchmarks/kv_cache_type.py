"""q8_0 vs bf16 KV cache (--cache-type-k / --cache-type-v): decode speed at long context and KV bytes per token.

Usage: python benchmarks/kv_cache_type.py --offline [--rows 16] [--context 2048] [--steps 24] [--kernel-arch native]
       [--out results.md]

--offline: a ~1B-shaped Llama (Llama 3.2 1B's layer shapes: hidden 2048, 16 layers, 32 heads / 8 KV heads of
64, intermediate 8192; SmolLM2's vocabulary) with random bf16 weights, through the engine. Each of --rows
sequences joins the batch with --context tokens of K/V already in the cache: they arrive through the KV
handoff import (engine/kv_transfer.py), so no 32k-token prefill is timed or waited for; the K/V are random
values in the cache's own format (attention costs the same for any values). Then --steps decode steps of all
rows are timed (median ms per step; the engines for each cache type step in turn, so the shared machine's
load falls on all alike). Also: the attention kernel alone on one layer of that batch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)
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
    try:
        tensor.untyped_storage().resize_(0)  # the model holds its own (packed) copy now
    except RuntimeError:
        pass  # a view the loader made (e.g. blocks quantized at load): freed with its owner


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


def start_rows(core: EngineCore, rows: int, context: int, steps: int) -> None:
    """`rows` sequences join the running batch with `context` tokens of K/V each (the handoff import)."""
    blob = random_blob(core, context)
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(rows):
        request = core.make_request([100 + (i * 7 + j) % 1000 for j in range(context)], params, f"r{i}")
        request.output_token_ids = [42]
        core.kv_transfer.stage_import(request, blob)
        core.add_request(request)
    assert core.kv_transfer.stats.num_imported == rows, "every row must join with its K/V (pool too small?)"


def interleaved_steps(cores: dict[str, EngineCore]) -> dict[str, float]:
    """Median ms per decode step of each engine, their steps alternating (the machine's load hits all alike)."""
    times: dict[str, list[float]] = {kind: [] for kind in cores}
    while any(core.has_work() for core in cores.values()):
        for kind, core in cores.items():
            if core.has_work():
                start = time.perf_counter()
                core.step()
                times[kind].append(time.perf_counter() - start)
    return {kind: statistics.median(t[2:]) * 1e3 for kind, t in times.items()}  # the first steps warm up


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
    for _ in range(repeats):
        start = time.perf_counter()
        core.backend.paged_attention(query, key_cache, value_cache, meta, cfg.head_dim ** -0.5)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def offline(args: argparse.Namespace) -> None:
    tokenizer = smollm_tokenizer()
    config = ModelConfig(vocab_size=tokenizer.vocab_size, max_position_embeddings=args.context + 256,
                         rms_norm_eps=1e-5, eos_token_ids=tuple(tokenizer.eos_token_ids), **SHAPE_1B)
    cores = {}
    for kind in args.types.split(","):  # every engine alive at once, so their steps can alternate
        checkpoint = Checkpoint(config=config, weights=random_llama(config), tokenizer=tokenizer, source="<random>",
                                name="random-llama-1b-shape", release_pages=_drop)
        cores[kind] = EngineCore(EngineConfig(parallel=args.rows, ctx_size=args.rows * (args.context + 256),
                                              kv_cache_budget="none", speculative_ngram=0,
                                              weight_dtype=args.weight_dtype, cache_type_k=kind, cache_type_v=kind,
                                              kernel_arch=args.kernel_arch),
                                 checkpoint=checkpoint)
        del checkpoint
        start_rows(cores[kind], args.rows, args.context, args.steps)
    step_ms = interleaved_steps(cores)
    attn_ms = {kind: [] for kind in cores}
    for _ in range(args.steps):
        for kind, core in cores.items():
            attn_ms[kind].append(attention_ms(core, args.rows, args.context, 1))
    results = {}
    for kind, core in cores.items():
        per_token = core.pool_plan.bytes_per_block // core.kv.block_size
        results[kind] = (per_token, step_ms[kind], statistics.median(attn_ms[kind]))
        print(f"{kind}: {per_token} KV bytes/token, decode {step_ms[kind]:.1f} ms/step "
              f"({args.rows * 1e3 / step_ms[kind]:.1f} tok/s), attention one layer {results[kind][2]:.2f} ms", flush=True)
    base = results.get("bf16")
    rows = [[kind, f"{b:,} ({b / base[0]:.3f}x)" if base else f"{b:,}", f"{ms:.1f}",
             f"{args.rows * 1e3 / ms:.1f}" + (f" ({base[1] / ms:.2f}x)" if base else ""),
             f"{attn:.2f}" + (f" ({base[2] / attn:.2f}x)" if base else "")]
            for kind, (b, ms, attn) in results.items()]
    header = ["K and V cache type", "KV bytes per token", "decode ms/step", f"decode tok/s ({args.rows} rows)",
              "attention, one layer (ms)"]
    caption = (f"KV cache types: {args.rows} sequences decoding at {args.context} tokens of context, a ~1B-shaped "
               f"Llama (16 layers, 32/8 heads of 64, hidden 2048), random weights as {args.weight_dtype}, kernels "
               f"-march={args.kernel_arch}; median of {args.steps} steps, the engines' steps interleaved. Machine: {machine()}.")
    emit_table(caption, header, rows, args.out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--offline", action="store_true", help="through the engine in this process (the only mode)")
    p.add_argument("--types", default="bf16,q8_0", help="cache types to compare (K and V alike)")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--weight-dtype", default="bf16", help="--weight-dtype of the model (bf16, q8_0, q4_0)")
    p.add_argument("--kernel-arch", default="native",
                   help="-march of the kernels (x86-64-v3: the AVX2 level; also set ATEN_CPU_CAPABILITY=avx2 "
                        "ONEDNN_MAX_CPU_ISA=AVX2 to cap torch there)")
    p.add_argument("--out", default=None, help="append the table to this markdown file")
    args = p.parse_args()
    if not args.offline:
        p.error("only --offline is implemented: run with --offline")
    offline(args)


if __name__ == "__main__":
    main()
