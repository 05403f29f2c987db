"""Tick policy A/B: a long prompt admitted while N streams decode (SmolLM2, offline engine).

Reports, per policy, the streams' inter-token latency p50/p95 during the admission window
(from the long request's arrival to its first token) and the long request's TTFT.
Usage: python benchmarks/tick_policy.py [--streams 4] [--long-tokens 2048] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from offline_throughput import emit_table, machine


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def run(policy: str, streams: int, long_tokens: int, interval: int) -> dict:
    llm = LLM(parallel=streams + 1, tick_policy=policy, prefill_grant_interval=interval,
              enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    rows = [engine.make_request(llm.tokenizer.encode(f"Tell me a long story number {i}."), params)
            for i in range(streams)]
    for r in rows:
        engine.add_request(r)
    while not all(len(r.output_token_ids) >= 8 for r in rows):
        engine.step()
    words = ("alpha beta gamma delta epsilon zeta eta theta " * (long_tokens // 8 + 1)).split()[:long_tokens]
    long = engine.make_request(llm.tokenizer.encode(" ".join(words))[:long_tokens],
                               SamplingParams(temperature=0, max_tokens=1))
    last = {r.request_id: time.perf_counter() for r in rows}
    gaps: list[float] = []
    start = time.perf_counter()
    engine.add_request(long)
    while not long.output_token_ids:
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id in last:
                gaps.append(now - last[out.request_id])
                last[out.request_id] = now
    ttft = time.perf_counter() - start
    stats = engine.scheduler.stats
    return dict(policy=policy, ttft_s=ttft, itl_p50_ms=1000 * percentile(gaps, 0.5),
                itl_p95_ms=1000 * percentile(gaps, 0.95), itl_mean_ms=1000 * statistics.fmean(gaps),
                stream_tokens=len(gaps), grants=stats.num_prefill_grants, mixed=stats.num_mixed_steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=2048)
    parser.add_argument("--grant-interval", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = [run(p, args.streams, args.long_tokens, args.grant_interval) for p in ("mixed", "alternate")]
    caption = (f"Machine: {machine()}. SmolLM2-135M bf16, {args.streams} streams decoding, a {args.long_tokens}-token "
               f"prompt admitted; adaptive chunk (512 while decoding), grant interval {args.grant_interval}.")
    header = ["policy", "long TTFT s", "stream ITL p50 ms", "ITL p95 ms", "ITL mean ms", "stream tokens in window",
              "grants", "mixed steps"]
    emit_table(caption, header, [[r["policy"], f"{r['ttft_s']:.2f}", f"{r['itl_p50_ms']:.1f}", f"{r['itl_p95_ms']:.1f}",
                                  f"{r['itl_mean_ms']:.1f}", str(r["stream_tokens"]), str(r["grants"]), str(r["mixed"])]
                                 for r in results], args.out)


if __name__ == "__main__":
    main()
