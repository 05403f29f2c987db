"""Hybrid models (recurrent layers beside attention) at real shapes, random bf16 weights, offline through the
engine: decode throughput at C=1 and C=16, what a sequence keeps (recurrent state, K/V per token) against the
same shape with attention in every layer, and decode speed at a long context, where attention-only models slow
down and the recurrent layers do not.

Usage:
  PYTHONPATH=$PWD python benchmarks/hybrid.py [--shapes lfm2-350m,lfm2-1.2b,qwen3.5-0.8b] [--concurrency 1,16]
        [--max-tokens 64] [--long-context 4096] [--out benchmarks/results.md]

Shapes: LFM2-350M / 1.2B from their published configs (10 short-conv + 6 attention layers); Qwen3.5-0.8B from
its published card (24 layers, 6 x (3 DeltaNet + 1 attention), hidden 1024, 8 heads / 2 KV of 256, FFN 3584;
the DeltaNet head counts, 16 key and 16 value heads of 128, are assumed). SmolLM2's 49,152-token vocabulary
for all (the head costs the same in every row).
"""

from __future__ import annotations

import argparse
import time

import torch

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.loading import Checkpoint
from conveyor.models.config import ModelConfig
from conveyor.testing import random_hybrid_weights, smollm_tokenizer

from offline_throughput import emit_table, machine  # noqa: E402  (benchmarks/ on sys.path when run as a script)

_LFM2_ATTN = (2, 5, 8, 10, 12, 14)
SHAPES: dict[str, dict] = {
    "lfm2-350m": dict(architecture="lfm2", hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=64, intermediate_size=4608, qk_norm=True, conv_kernel_size=3,
                      tie_word_embeddings=True, rope_theta=1e6,
                      layer_types=tuple("full_attention" if i in _LFM2_ATTN else "conv" for i in range(16))),
    "lfm2-1.2b": dict(architecture="lfm2", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, intermediate_size=8192, qk_norm=True, conv_kernel_size=3,
                      tie_word_embeddings=True, rope_theta=1e6,
                      layer_types=tuple("full_attention" if i in _LFM2_ATTN else "conv" for i in range(16))),
    "qwen3.5-0.8b": dict(architecture="qwen3_5_text", hidden_size=1024, num_hidden_layers=24, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=256, intermediate_size=3584, qk_norm=True,
                         attn_output_gate=True, partial_rotary_factor=0.25, norm_weight_offset=1.0, rope_theta=1e7,
                         conv_kernel_size=4, linear_num_key_heads=16, linear_num_value_heads=16,
                         linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=True,
                         layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                           for i in range(24))),
}


def _drop(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)  # the model holds its own copy now: free the source as it loads


def run(llm: LLM, concurrency: int, max_tokens: int, prompt_words: int = 8) -> float:
    prompts = [f"Note {i}: " + "a short note about a topic " * max(prompt_words // 6, 1) for i in range(concurrency)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, [params] * concurrency)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def decode_rate(llm: LLM, context: int, max_tokens: int) -> float:
    """Decode tok/s of one request after a `context`-token prompt (prefill timed separately and left out)."""
    prompt = llm.tokenizer.encode("word " * context)[:context]
    engine = llm.engine
    engine.add_request(engine.make_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                  ignore_eos=True)))
    started, generated = None, 0
    while engine.has_work():
        for out in engine.step():
            if started is None and out.new_token_ids:
                started = time.perf_counter()  # first token: the prefill is done
            elif started is not None:
                generated += len(out.new_token_ids)
    return generated / (time.perf_counter() - started)


def kv_bytes_per_token(config: ModelConfig, attention_layers: int) -> int:
    return 2 * attention_layers * config.num_key_value_heads * config.head_dim * 2  # K and V, bf16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--concurrency", default="1,16", type=lambda s: [int(c) for c in s.split(",")])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--long-context", type=int, default=4096, help="prompt length of the long-context decode row")
    p.add_argument("--out", help="append the markdown table to this file")
    args = p.parse_args()
    tokenizer = smollm_tokenizer()
    rows = []
    for name in args.shapes.split(","):
        config = ModelConfig(vocab_size=tokenizer.vocab_size, max_position_embeddings=args.long_context + 1024,
                             rms_norm_eps=1e-6, eos_token_ids=tuple(tokenizer.eos_token_ids), **SHAPES[name])
        weights = random_hybrid_weights(config, scale=0.02, dtype=torch.bfloat16)
        checkpoint = Checkpoint(config=config, weights=weights, tokenizer=tokenizer, source="<random>", name=name,
                                release_pages=_drop)
        del weights
        llm = LLM(checkpoint=checkpoint, parallel=max(args.concurrency), speculative_ngram=0,
                  ctx_size=max(args.concurrency) * (args.long_context + 1024), kv_unified=True)
        del checkpoint
        run(llm, 1, 4)  # warm-up
        speeds = [run(llm, c, args.max_tokens) for c in args.concurrency]
        short, long = decode_rate(llm, 64, args.max_tokens), decode_rate(llm, args.long_context, args.max_tokens)
        state = llm.engine.states.bytes_per_slot
        hybrid_kv = kv_bytes_per_token(config, config.num_attention_layers)
        full_kv = kv_bytes_per_token(config, config.num_hidden_layers)
        print(f"{name}: " + ", ".join(f"C={c} {s:.1f} tok/s" for c, s in zip(args.concurrency, speeds))
              + f"; decode at 64 / {args.long_context} tokens {short:.1f} / {long:.1f} tok/s", flush=True)
        rows.append([name, f"{config.num_attention_layers}/{config.num_hidden_layers}"]
                    + [f"{s:.1f}" for s in speeds]
                    + [f"{short:.1f} / {long:.1f} ({long / short:.2f}x)", f"{state / 2**20:.2f}",
                       f"{hybrid_kv / 1024:.0f} KiB", f"{full_kv / 1024:.0f} KiB",
                       f"{(state + args.long_context * hybrid_kv) / (args.long_context * full_kv):.2f}"])
        del llm
    header = (["shape", "attention layers"] + [f"C={c} tok/s" for c in args.concurrency]
              + [f"C=1 decode tok/s at 64 / {args.long_context} tokens", "state per sequence (MiB)",
                 "K/V per token", "K/V per token, attention everywhere",
                 f"memory per {args.long_context}-token sequence vs attention everywhere"])
    caption = (f"Hybrid models at real shapes, random bf16 weights, SmolLM2 vocabulary; {args.max_tokens} greedy "
               f"tokens per request (C=1/16 rows: prefill included). Machine: {machine()}.")
    emit_table(caption, header, rows, args.out)


if __name__ == "__main__":
    main()
