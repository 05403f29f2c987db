"""Issue #27: TTFT after a server restart with the prefix cache's disk tier warm, against an empty cache.

1. prime: `conveyor serve --prompt-cache-dir WARM` answers one request carrying a ~4k-token system prompt,
   then gets SIGTERM: the shutdown writes its cached blocks to WARM.
2. warm: a fresh server on WARM (a restart) gets 16 concurrent requests sharing that system prompt (each
   with its own question); TTFT per request, and the disk tier's hits from /v1/cache/stats. The server reads
   the newest blocks into RAM as it starts (--prompt-cache-preload, default 1G); `--no-preload` gives
   --prompt-cache-preload 0, so the burst's first request reads them on its way (the on-demand path).
3. cold: a fresh server on an empty directory gets the same 16 requests.
The greedy outputs of warm and cold must be identical. The default model (SmolLM2, conveyor's default
when no --model is given) unless --model says otherwise.

Usage: python benchmarks/prompt_cache_disk.py [--model PATH] [--no-preload] [--repeat N] [--system-tokens 4096] [--requests 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from server_process import free_port, sse_events  # a sibling script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the agent reads the tool output, checks the schema, writes a plan and calls the next tool with "
         "arguments drawn from the user's request; it never invents fields and it reports errors plainly. ").split()


def system_prompt(tokenizer, num_tokens: int) -> str:
    """About num_tokens tokens of instructions (the tokenizer decides the exact count)."""
    text, i = "", 0
    while len(tokenizer.encode(text)) < num_tokens:
        text += " ".join(WORDS[(i + j) % len(WORDS)] for j in range(50)) + f" Rule {i}.\n"
        i += 1
    return text



def start_server(args: argparse.Namespace, cache_dir: str, log_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "conveyor.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--prompt-cache-dir", cache_dir, "--speculative-ngram", "0", "--ctx-size", str(args.ctx_size),
           "--kv-unified", "--parallel", str(args.parallel)]
    if args.model:
        cmd += ["--model", args.model]
    if args.no_preload:
        cmd += ["--prompt-cache-preload", "0"]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"server not healthy after {args.start_timeout:.0f} s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> float:
    """SIGTERM and wait (the engine writes its cached blocks on the way out); returns seconds taken."""
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return time.monotonic() - started


async def one_request(client: httpx.AsyncClient, url: str, system: str, question: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, text, cached = None, "", None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for chunk in sse_events(r):
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - start
                text += piece
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - start, "text": text,
            "cached_tokens": cached}


async def burst(url: str, system: str, questions: list[str], max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600)) as client:
        return await asyncio.gather(*(one_request(client, url, system, q, max_tokens) for q in questions))


def phase(args, cache_dir: str, system: str, questions: list[str], name: str) -> dict:
    proc, url = start_server(args, cache_dir, os.path.join(args.log_dir, f"{name}.log"))
    try:
        started = time.perf_counter()
        results = asyncio.run(burst(url, system, questions, args.max_tokens))
        wall = time.perf_counter() - started
        stats = httpx.get(f"{url}/v1/cache/stats", timeout=30).json()
    finally:
        stop_s = stop_server(proc)
    ttfts = sorted(r["ttft_s"] for r in results)
    return {"name": name, "wall_s": wall, "ttft_first_s": ttfts[0], "ttft_p50_s": ttfts[len(ttfts) // 2],
            "ttft_mean_s": statistics.mean(ttfts), "ttft_max_s": ttfts[-1], "stop_s": stop_s,
            "texts": [r["text"] for r in results], "cached_tokens": [r["cached_tokens"] for r in results],
            "disk": stats["tiers"]["disk"], "prefix_cache": stats["prefix_cache"]}


def lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model path (default: conveyor's default SmolLM2)")
    parser.add_argument("--system-tokens", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ctx-size", type=int, default=8192)
    parser.add_argument("--parallel", type=int, default=16, help="server slots (16: every request runs at once)")
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument("--repeat", type=int, default=1, help="whole comparisons to run (a noisy host: read the median)")
    parser.add_argument("--no-preload", action="store_true", help="--prompt-cache-preload 0 on every server")
    parser.add_argument("--out", help="write the JSON result here")
    args = parser.parse_args()

    from conveyor.loading import default_model_path, load_checkpoint

    tokenizer = load_checkpoint(args.model or default_model_path()).tokenizer
    system = system_prompt(tokenizer, args.system_tokens)
    questions = [f"Task {i}: summarise rule {i} in one sentence." for i in range(args.requests)]
    runs = [one_run(args, tokenizer, system, questions) for _ in range(args.repeat)]
    ratios = [r["cold"]["ttft_mean_s"] / r["warm"]["ttft_mean_s"] for r in runs]
    identical = all(r["outputs_identical"] for r in runs)
    result = {"cpu": lscpu_model(), "system_tokens": len(tokenizer.encode(system)), "requests": args.requests,
              "runs": runs, "mean_ttft_ratios": ratios, "median_ratio": statistics.median(ratios),
              "outputs_identical": identical}
    print(json.dumps(result, indent=2))
    print(f"\n| run | cache at restart | TTFT first | TTFT p50 | TTFT mean | TTFT max | burst wall | disk hits (preloaded) "
          f"| mean ratio |\n|---|---|---|---|---|---|---|---|---|")
    for n, (run, ratio) in enumerate(zip(runs, ratios), 1):
        for p in (run["warm"], run["cold"]):
            warm = p is run["warm"]
            print(f"| {n} | {'disk tier warm' if warm else 'empty'} | {p['ttft_first_s']:.2f} s | {p['ttft_p50_s']:.2f} s | "
                  f"{p['ttft_mean_s']:.2f} s | {p['ttft_max_s']:.2f} s | {p['wall_s']:.1f} s | {p['disk']['hits']} "
                  f"({p['disk'].get('preloaded', 0)}) | {'' if warm else f'**{ratio:.1f}x**'} |")
    last = runs[-1]
    print(f"\nmedian mean-TTFT ratio over {len(runs)} run(s): {statistics.median(ratios):.1f}x; outputs identical: "
          f"{identical}; prime shutdown (spill) took {last['prime']['stop_s']:.1f} s, {last['warm']['disk']['entries']} "
          f"blocks / {last['warm']['disk']['bytes'] / 2**20:.1f} MiB on disk")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if not identical:
        sys.exit(1)


def one_run(args, tokenizer, system: str, questions: list[str]) -> dict:
    """prime, restart warm, cold: one comparison in fresh directories."""
    with tempfile.TemporaryDirectory() as warm_dir, tempfile.TemporaryDirectory() as cold_dir, \
            tempfile.TemporaryDirectory() as log_dir:
        args.log_dir = log_dir
        prime = phase(args, warm_dir, system, questions[:1], "prime")
        warm = phase(args, warm_dir, system, questions, "warm")
        cold = phase(args, cold_dir, system, questions, "cold")
    return {"prime": {k: v for k, v in prime.items() if k != "texts"},
            "warm": {k: v for k, v in warm.items() if k != "texts"},
            "cold": {k: v for k, v in cold.items() if k != "texts"},
            "outputs_identical": warm["texts"] == cold["texts"]}

if __name__ == "__main__":
    main()
