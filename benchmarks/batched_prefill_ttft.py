"""TTFT of N simultaneous ~500-token arrivals: the scheduler of another source tree (before) against
this one (after), interleaved run by run, SmolLM2 on the offline engine.

Each measurement runs in a fresh process with PYTHONPATH pointing at one tree, so both see the same
machine load; the order alternates every round. Two situations: an idle server, and one where
`--streams` rows are already decoding when the burst arrives.

Usage: git archive <old commit> | tar -x -C /tmp/conveyor-old
       python benchmarks/batched_prefill_ttft.py --old-src /tmp/conveyor-old [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(streams: int, arrivals: int, prompt_tokens: int) -> dict:
    import conveyor
    from conveyor.engine.llm import LLM
    from conveyor.engine.sampling_params import SamplingParams

    llm = LLM(parallel=streams + arrivals, enable_prefix_caching=False, speculative_ngram=0)
    engine = llm.engine
    llm.generate(["warm up the kernels"], SamplingParams(temperature=0, max_tokens=4))
    rows = [engine.make_request(llm.tokenizer.encode(f"Tell me a long story number {i}."),
                                SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True))
            for i in range(streams)]
    for r in rows:
        engine.add_request(r)
    while not all(len(r.output_token_ids) >= 4 for r in rows):
        engine.step()
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda river stone cloud".split()
    burst = []
    for i in range(arrivals):
        text = f"Request {i}: " + " ".join(rng.choice(words) for _ in range(prompt_tokens))
        ids = llm.tokenizer.encode(text)[:prompt_tokens]
        burst.append(engine.make_request(ids, SamplingParams(temperature=0, max_tokens=1)))
    start = time.perf_counter()
    for r in burst:
        engine.add_request(r)
    ttft: dict[str, float] = {}
    stream_tokens_before = sum(len(r.output_token_ids) for r in rows)
    while len(ttft) < len(burst):
        engine.step()
        now = time.perf_counter()
        for r in burst:
            if r.output_token_ids and r.request_id not in ttft:
                ttft[r.request_id] = now - start
    window = time.perf_counter() - start
    values = sorted(ttft.values())
    return {"src": os.path.dirname(os.path.dirname(conveyor.__file__)), "streams": streams,
            "ttft_mean_ms": 1000 * statistics.mean(values), "ttft_p50_ms": 1000 * values[len(values) // 2],
            "ttft_max_ms": 1000 * values[-1],
            "stream_tokens_in_window": sum(len(r.output_token_ids) for r in rows) - stream_tokens_before,
            "window_s": window}


def run_child(src: str, streams: int, arrivals: int, prompt_tokens: int) -> dict:
    env = dict(os.environ, PYTHONPATH=src)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--streams", str(streams),
           "--arrivals", str(arrivals), "--prompt-tokens", str(prompt_tokens)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old-src", help="source tree of the 'before' scheduler")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arrivals", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--streams", type=str, default="0,4", help="decoding rows when the burst arrives")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(int(args.streams), args.arrivals, args.prompt_tokens)))
        return
    trees = {"before": args.old_src, "after": os.path.dirname(HERE)}
    results: dict[tuple[str, int], list[dict]] = {}
    for round_index in range(args.rounds):
        order = list(trees) if round_index % 2 == 0 else list(reversed(list(trees)))
        for streams in (int(s) for s in args.streams.split(",")):
            for label in order:
                result = run_child(trees[label], streams, args.arrivals, args.prompt_tokens)
                results.setdefault((label, streams), []).append(result)
                print(f"round {round_index} {label:6} streams={streams} ttft mean {result['ttft_mean_ms']:.0f} ms "
                      f"max {result['ttft_max_ms']:.0f} ms ({result['src']})", flush=True)
    lines = [f"{args.arrivals} simultaneous {args.prompt_tokens}-token arrivals, SmolLM2-135M, offline engine, "
             f"{args.rounds} interleaved rounds (median of rounds)", "",
             "| decoding rows | scheduler | TTFT mean ms | TTFT p50 ms | TTFT max (last arrival) ms | stream tokens during burst |",
             "|---|---|---|---|---|---|"]
    for (label, streams), runs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0] != "before")):
        med = {k: statistics.median(r[k] for r in runs) for k in ("ttft_mean_ms", "ttft_p50_ms", "ttft_max_ms",
                                                                   "stream_tokens_in_window")}
        lines.append(f"| {streams} | {label} | {med['ttft_mean_ms']:.0f} | {med['ttft_p50_ms']:.0f} | "
                     f"{med['ttft_max_ms']:.0f} | {med['stream_tokens_in_window']:.0f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
