"""One long prompt's time to first token on a GGUF, paged attention on the amx build's tiles (csrc/paged_amx.h)
against its row path (CONVEYOR_PAGED_AMX=0), each in its own process, interleaved; the offline engine, prefix cache
off, the adaptive prefill chunk (2,048 idle), wall time of generate(max_tokens=1) after a warm-up.

  flock -x /tmp/bench.lock python benchmarks/prefill_attention_ttft.py FILE.gguf --tokens 1500 4000 [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(path: str, tokens: int) -> float:
    sys.path.insert(0, ROOT)
    from conveyor.engine.llm import LLM
    from conveyor.engine.sampling_params import SamplingParams
    llm = LLM(model=path, parallel=1, ctx_size=8192, enable_prefix_caching=False, kv_cache_budget="none")
    text = open(os.path.join(os.path.dirname(os.__file__), "LICENSE.txt")).read()
    ids = llm.engine.tokenizer.encode(text)
    ids = (ids * (tokens // len(ids) + 1))[:tokens]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([ids[:64]], [params])  # warm-up: kernels loaded, pools touched
    start = time.perf_counter()
    llm.generate([ids], [params])
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("file")
    p.add_argument("--tokens", type=int, nargs="+", default=[1500])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.file, args.child)))
        return
    results: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for tokens in args.tokens:
            paths = [("rows", "0"), ("amx tiles", "1")]
            for name, flag in paths if r % 2 == 0 else paths[::-1]:
                out = subprocess.run([sys.executable, __file__, args.file, "--child", str(tokens)], check=True,
                                     capture_output=True, text=True, env={**os.environ, "CONVEYOR_PAGED_AMX": flag})
                results.setdefault((name, tokens), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(name, tokens, f"{results[(name, tokens)][-1]:.2f} s", file=sys.stderr, flush=True)
    print("| prompt tokens | rows: TTFT s (tok/s) | amx tiles: TTFT s (tok/s) | speedup |\n|---|---|---|---|")
    for tokens in args.tokens:
        before, after = (statistics.median(results[(n, tokens)]) for n in ("rows", "amx tiles"))
        print(f"| {tokens} | {before:.2f} ({tokens / before:.0f}) | {after:.2f} ({tokens / after:.0f}) "
              f"| {before / after:.2f}x |")


if __name__ == "__main__":
    main()
