"""Decode throughput of each dense family at its real shapes (random bf16 weights), offline through the engine.

Usage:
  PYTHONPATH=$PWD python benchmarks/families.py [--families llama-1b,gemma3-270m,gemma3-1b,gemma2-2b,olmo2-1b,
        granite-2b,phi3-mini] [--concurrency 1,16] [--max-tokens 64] [--weight-dtype auto|q8_0|q4_0]
        [--layers N] [--out benchmarks/results.md]

Each family is built from the shapes of its smallest release (hidden size, layers, heads, head_dim, FFN,
windows, norms, gate; docs/models.md) with SmolLM2's 49,152-token vocabulary and tokenizer for all, so the
head costs the same everywhere and the rows compare the decoder shapes. For each concurrency C it runs C
greedy requests (short chat-sized prompts, ignore_eos, --max-tokens each) through LLM.generate and reports
generated tokens over wall time, prefill included (conveyor bench's output tok/s). --layers caps the depth
for a quick check. Gemma 3 270M against llama-server on the real file is benchmarks/quantized.py
(--files gemma3-270m).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)
import torch

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.loading import Checkpoint
from conveyor.models.config import ModelConfig
from conveyor.testing import smollm_tokenizer

from offline_throughput import emit_table, machine  # noqa: E402  (benchmarks/ on sys.path when run as a script)

GEMMA = dict(norm_layout="sandwich", hidden_act="gelu_tanh", norm_weight_offset=1.0, tie_word_embeddings=True)
SHAPES: dict[str, dict] = {
    "llama-1b": dict(architecture="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, intermediate_size=8192, tie_word_embeddings=True),
    "gemma3-270m": dict(architecture="gemma3_text", hidden_size=640, num_hidden_layers=18, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=256, intermediate_size=2048, qk_norm=True,
                        sliding_window=512, local_rope_theta=1e4, rope_theta=1e6, attention_scale=256 ** -0.5,
                        embedding_multiplier=640 ** 0.5, **GEMMA),
    "gemma3-1b": dict(architecture="gemma3_text", hidden_size=1152, num_hidden_layers=26, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=256, intermediate_size=6912, qk_norm=True,
                      sliding_window=512, local_rope_theta=1e4, rope_theta=1e6, attention_scale=256 ** -0.5,
                      embedding_multiplier=1152 ** 0.5, **GEMMA),
    "gemma2-2b": dict(architecture="gemma2", hidden_size=2304, num_hidden_layers=26, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, intermediate_size=9216, sliding_window=4096,
                      attention_scale=256 ** -0.5, embedding_multiplier=2304 ** 0.5, attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0, **GEMMA),
    "olmo2-1b": dict(architecture="olmo2", hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                     num_key_value_heads=16, head_dim=128, intermediate_size=8192, norm_layout="post",
                     qk_norm=True, qk_norm_scope="full"),
    "granite-2b": dict(architecture="granite", hidden_size=2048, num_hidden_layers=40, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=64, intermediate_size=8192, tie_word_embeddings=True,
                       embedding_multiplier=12.0, attention_scale=0.015625, residual_multiplier=0.22,
                       logits_scaling=8.0),
    "phi3-mini": dict(architecture="phi3", hidden_size=3072, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, head_dim=96, intermediate_size=8192, sliding_window=2047),
}
_WINDOWED = {"gemma3": 6, "gemma2": 2}  # every n-th layer global


def family_config(name: str, vocab_size: int, eos: tuple[int, ...], layers: int | None) -> ModelConfig:
    shape = dict(SHAPES[name])
    if layers:
        shape["num_hidden_layers"] = min(layers, shape["num_hidden_layers"])
    pattern = _WINDOWED.get(name.split("-")[0])
    if pattern:
        shape["layer_types"] = tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                     for i in range(shape["num_hidden_layers"]))
    return ModelConfig(vocab_size=vocab_size, max_position_embeddings=4096, rms_norm_eps=1e-6, eos_token_ids=eos,
                       **shape)


def random_bf16_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named random weights made in bf16 (a 3.8B model would need 15 GB in fp32)."""
    gen = torch.Generator().manual_seed(seed)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d

    def rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": rand(config.vocab_size, h, scale=1.0), "model.norm.weight": rand(h)}
    full = config.qk_norm_scope == "full"
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        weights.update({p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
                        p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
                        p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                        p + "mlp.down_proj.weight": rand(h, i)})
        weights.update({p + f"{norm}.weight": 1 + rand(h) for norm in config.layer_norm_names})
        if config.qk_norm:
            weights[p + "self_attn.q_norm.weight"] = 1 + rand(q if full else d)
            weights[p + "self_attn.k_norm.weight"] = 1 + rand(kv if full else d)
    return weights


def _drop(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)  # the model holds its own copy now: free the source as it loads


def run(llm: LLM, concurrency: int, max_tokens: int) -> float:
    prompts = [f"Write a short note about topic number {i}, please." for i in range(concurrency)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, [params] * concurrency)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(SHAPES))
    p.add_argument("--concurrency", default="1,16", type=lambda s: [int(c) for c in s.split(",")])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--weight-dtype", default="auto", help="auto (bf16 here), q8_0 or q4_0 (quantized at load)")
    p.add_argument("--layers", type=int, default=0, help="cap the depth (quick checks; 0 = the real depth)")
    p.add_argument("--out", help="append the markdown table to this file")
    args = p.parse_args()
    tokenizer = smollm_tokenizer()
    rows = []
    for name in args.families.split(","):
        config = family_config(name, tokenizer.vocab_size, tuple(tokenizer.eos_token_ids), args.layers)
        checkpoint = Checkpoint(config=config, weights=random_bf16_weights(config), tokenizer=tokenizer,
                                source="<random>", name=name, release_pages=_drop)
        llm = LLM(checkpoint=checkpoint, parallel=max(args.concurrency), speculative_ngram=0,
                  ctx_size=max(args.concurrency) * 1024, weight_dtype=args.weight_dtype)
        del checkpoint
        run(llm, 1, 4)  # warm-up
        speeds = [run(llm, c, args.max_tokens) for c in args.concurrency]
        print(f"{name}: " + ", ".join(f"C={c} {s:.1f} tok/s" for c, s in zip(args.concurrency, speeds)), flush=True)
        rows.append([name, config.architecture, str(config.num_hidden_layers), str(config.hidden_size)]
                    + [f"{s:.1f}" for s in speeds])
        del llm
    header = ["shape", "architecture", "layers", "hidden"] + [f"C={c} tok/s" for c in args.concurrency]
    caption = (f"Dense families at their real shapes, random bf16 weights (--weight-dtype {args.weight_dtype}), "
               f"SmolLM2 vocabulary; {args.max_tokens} greedy tokens per request, prefill included. "
               f"Machine: {machine()}.")
    emit_table(caption, header, rows, args.out)


if __name__ == "__main__":
    main()
