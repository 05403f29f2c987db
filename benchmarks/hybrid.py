"""Hybrid models (recurrent layers beside attention): conveyor against llama-server on the same GGUF file, and
offline through the engine.

Server comparison (the default), one run per file, one server after the other:
  PYTHONPATH=$PWD python benchmarks/hybrid.py --files /work/bench-models/qwen3.5-2b-Q4_K_M.gguf,...
        [--llama-server /work/llama-native/bin/llama-server] [--out benchmarks/results.md]
For each file: output tok/s at C=1 and C=16 (`conveyor bench`, greedy, 64 tokens, ~32-token prompts), TTFT of
one 1.5k-token prompt, 16 chat requests sharing a 1k-token system prompt sent together after two warm-up
requests with that system prompt (wall time and mean TTFT: prefix hits), RSS after start and at peak. Both
servers get 16 slots, the same context, speculation off (conveyor --speculative-ngram 0), llama-server -t <cores>.
Files: benchmarks/hybrid_gguf.py writes real-shaped random-weight GGUFs as llama.cpp's converter does.

Offline (--offline): real shapes with random bf16 weights through the engine: C=1 and C=16 tok/s, what a
sequence keeps (recurrent state, K/V per token) against the same shape with attention in every layer, and decode
speed at a long context, where attention-only models slow down and the recurrent layers do not:
  PYTHONPATH=$PWD python benchmarks/hybrid.py --offline [--shapes lfm2-350m,lfm2-1.2b,qwen3.5-0.8b]
        [--concurrency 1,16] [--max-tokens 64] [--long-context 4096] [--out benchmarks/results.md]

Shapes: LFM2-350M / 1.2B from their published configs (10 short-conv + 6 attention layers); Qwen3.5-0.8B from
its published card (24 layers, 6 x (3 DeltaNet + 1 attention), hidden 1024, 8 heads / 2 KV of 256, FFN 3584;
the DeltaNet head counts, 16 key and 16 value heads of 128, are assumed). SmolLM2's 49,152-token vocabulary
for all (the head costs the same in every row).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import httpx
import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)
import torch

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.loading import Checkpoint
from conveyor.models.config import ModelConfig
from conveyor.testing import random_hybrid_weights, smollm_tokenizer

from offline_throughput import emit_table, machine  # noqa: E402  (benchmarks/ on sys.path when run as a script)
import quantized  # noqa: E402

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


def offline(args: argparse.Namespace) -> None:
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


# ---------------------------------------------------------------- conveyor vs llama-server


def _has_token(line: str) -> bool:
    """An SSE line carrying generated text (not the role-only first chunk of a chat stream)."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return False
    choice = (json.loads(line[6:]).get("choices") or [{}])[0]
    delta = choice.get("delta") or {}
    return bool(choice.get("text") or delta.get("content") or delta.get("reasoning_content"))


async def _stream_ttft(client: httpx.AsyncClient, path: str, body: dict) -> float:
    """Seconds to the first streamed token of one request."""
    start, ttft = time.perf_counter(), None
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():  # read to the end, so the slot is free for the next request
            if ttft is None and _has_token(line):
                ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError("no token streamed")
    return ttft


def long_prompt_ttft(url: str, tokens: int) -> float:
    words = " ".join(f"w{i % 97}" for i in range(tokens // 2))  # ~2 tokens per word in SmolLM2's vocabulary
    body = {"prompt": words, "max_tokens": 1, "temperature": 0}

    async def go() -> float:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            return await _stream_ttft(client, "/v1/completions", body)
    return asyncio.run(go())


def shared_prefix_run(url: str, system_tokens: int, num: int) -> tuple[float, float]:
    """(wall s, mean TTFT s) of `num` chat requests sharing a system prompt, sent together after two warm-ups."""
    system = "You are a careful assistant. Rules: " + " ".join(f"rule{i} applies." for i in range(system_tokens // 4))

    def body(i: int) -> dict:
        return {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"}],
                "max_tokens": 16, "temperature": 0}

    async def go() -> tuple[float, float]:
        async with httpx.AsyncClient(base_url=url, timeout=900) as client:
            for i in range(2):  # the first sees nothing cached; the second's shared prefix is then known
                await _stream_ttft(client, "/v1/chat/completions", body(1000 + i))
            start = time.perf_counter()
            ttfts = await asyncio.gather(*(_stream_ttft(client, "/v1/chat/completions", body(i)) for i in range(num)))
            return time.perf_counter() - start, statistics.mean(ttfts)
    return asyncio.run(go())


def compare(args: argparse.Namespace) -> None:
    quantized.wait_quiet(args.quiet_cpu, args.quiet_timeout)
    bandwidth = args.bandwidth_gbs or quantized.measure_bandwidth(args.threads, 2.0, 5)
    print(f"read bandwidth {bandwidth:.1f} GB/s", flush=True)
    rows = []
    for file in args.files.split(","):
        path = Path(file)
        ctx = args.ctx or quantized.context_length(path)
        results = {}
        for server in ("conveyor", "llama-server"):
            port = quantized._free_port()
            cmd = quantized.server_command(server, args.llama_server, path, args, ctx, port)
            env = {**os.environ, "CONVEYOR_REQUIRE_KERNELS": "1"}
            url = f"http://127.0.0.1:{port}"
            print(f"{server} {path.name}: {' '.join(cmd)}", flush=True)
            with open(f"/tmp/hybrid-bench-{server}.log", "w") as log:
                proc = quantized.subprocess.Popen(cmd, env=env, cwd=quantized.ROOT, stdout=log,
                                                  stderr=quantized.subprocess.STDOUT)
                try:
                    quantized._wait_healthy(url, proc, args.start_timeout)
                    r = {"rss_start": quantized._proc_kb(proc.pid, "VmRSS")}
                    for i, c in enumerate(args.concurrency):
                        r[c], _, _ = quantized._measure(proc, url, c, i == 0, args, env, f"C={c}")
                    r["ttft"] = r["shared_wall"] = r["shared_ttft"] = float("nan")  # 0 tokens: not measured
                    if args.long_prompt:
                        r["ttft"] = long_prompt_ttft(url, args.long_prompt)
                        print(f"  TTFT of a {args.long_prompt}-token prompt: {r['ttft']:.2f} s", flush=True)
                    if args.system_tokens:
                        r["shared_wall"], r["shared_ttft"] = shared_prefix_run(url, args.system_tokens, args.parallel)
                        print(f"  {args.parallel} requests sharing a {args.system_tokens}-token system prompt: "
                              f"{r['shared_wall']:.2f} s, mean TTFT {r['shared_ttft']:.2f} s", flush=True)
                    r["rss_peak"] = quantized._proc_kb(proc.pid, "VmHWM")
                    results[server] = r
                finally:
                    quantized._stop(proc)
        ours, peer = results["conveyor"], results["llama-server"]
        limit = bandwidth * 1e9 / quantized.weight_bytes_per_token(path)  # decode tok/s if weights streamed at bandwidth
        for server, r in results.items():
            share = f" ({100 * r[1] / limit:.0f}% of {limit:.1f})" if 1 in r else ""
            rows.append([server, path.name, *[f"{r[c]:.1f}" + (share if c == 1 else "") for c in args.concurrency],
                         f"{r['ttft']:.2f}",
                         f"{r['shared_wall']:.2f} / {r['shared_ttft']:.2f}", f"{r['rss_start']:.0f}",
                         f"{r['rss_peak']:.0f}"])
        rows.append(["conveyor / llama-server", path.name,
                     *[f"{ours[c] / peer[c]:.2f}x" for c in args.concurrency],
                     f"{peer['ttft'] / ours['ttft']:.2f}x faster",
                     f"{peer['shared_wall'] / ours['shared_wall']:.2f}x faster",
                     f"{ours['rss_start'] / peer['rss_start']:.2f}", f"{ours['rss_peak'] / peer['rss_peak']:.2f}"])
    header = ["server", "file", *[f"C={c} tok/s" for c in args.concurrency], f"TTFT {args.long_prompt}-token prompt s",
              f"{args.parallel} x shared {args.system_tokens}-token system prompt: wall s / mean TTFT s",
              "RSS after start MiB", "peak RSS MiB"]
    caption = (f"Hybrid GGUFs, conveyor vs llama-server ({args.llama_server}), one run each, 16 slots, speculation "
               f"off; {args.max_tokens} greedy tokens per request at C=1/16; C=1 also as a share of the bandwidth "
               f"limit ({bandwidth:.1f} GB/s read / the weight bytes one step reads). Machine: {quantized.machine()}.")
    emit_table(caption, header, rows, args.out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--offline", action="store_true", help="through the engine, random bf16 weights (no server)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="--offline: shapes to build")
    p.add_argument("--files", default="", help="GGUF files to serve with both servers (benchmarks/hybrid_gguf.py)")
    p.add_argument("--concurrency", default="1,16", type=lambda s: [int(c) for c in s.split(",")])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--long-context", type=int, default=4096, help="--offline: prompt of the long-context decode row")
    p.add_argument("--long-prompt", type=int, default=1500, help="tokens of the TTFT prompt (0: skip it)")
    p.add_argument("--system-tokens", type=int, default=1000, help="tokens of the shared system prompt (0: skip)")
    p.add_argument("--parallel", type=int, default=16)
    p.add_argument("--ctx", type=int, default=4096, help="context per slot")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--requests-c1", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--llama-server", default="/work/llama-native/bin/llama-server")
    p.add_argument("--bandwidth-gbs", type=float, help="skip the measurement and use this read bandwidth")
    p.add_argument("--quiet-cpu", type=float, default=0.3)
    p.add_argument("--quiet-timeout", type=float, default=600.0)
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--out", help="append the markdown table to this file")
    args = p.parse_args()
    if args.offline:
        offline(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
