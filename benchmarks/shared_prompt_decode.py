"""Fan-out agents on one prompt: C requests that share a long prompt (a system prompt and tool list) and differ in a
short tail, streamed at once after one request has warmed the server, against a real `conveyor serve` (this checkout,
and optionally another, --base) and llama-server, the same token ids, greedy, ignore_eos.

Per server: the batch's wall time (first request sent -> last token), the median time to first token, and the decode
rate once every stream has its first token (tokens after that moment / the time from it to the last token).
conveyor finds the prompt's blocks in its prefix cache and its attention reads them once per call for all rows
(docs/kernels.md, "Decode rows on one shared prompt"); llama-server (`-np C`, one slot per request) has the prompt
cached in the warm-up's slot only.

  flock -x /tmp/bench.lock python benchmarks/shared_prompt_decode.py FILE.gguf [--prompt-tokens 4096] \
      [--concurrency 16] [--max-tokens 64] [--base /tmp/wt_base] [--llama-server PATH] [--json out.json]
      [--conveyor-args="--cache-type-k q8_0 --cache-type-v q8_0"]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from quantized import machine  # sibling scripts
from server_process import ServerProcess, free_port, sse_events

ROOT = Path(__file__).resolve().parent.parent


def prompt_ids(file: str, tokens: int, concurrency: int) -> list[list[int]]:
    """The shared part from Python's LICENSE text (the file's own tokenizer), then 8 ids of each request's own."""
    sys.path.insert(0, str(ROOT))
    from conveyor.cluster.serve import load_tokenizer  # noqa: E402
    tok, _ = load_tokenizer(file)
    text = open(os.path.join(os.path.dirname(os.__file__), "LICENSE.txt")).read()
    ids = tok.encode(text)
    shared = (ids * (tokens // len(ids) + 1))[:tokens - 8]
    return [shared + [ids[(97 * i + j) % len(ids)] for j in range(8)] for i in range(concurrency)]


async def stream_one(client: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int, t0: float) -> dict:
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    times = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for event in sse_events(response):
            if event.get("choices"):
                times.append(time.perf_counter() - t0)
    return {"first": times[0], "last": times[-1], "events": times}


async def run_batch(url: str, prompts: list[list[int]], max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=3600) as client:
        await stream_one(client, url, prompts[0], 1, time.perf_counter())  # warm-up: the prompt cached
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(stream_one(client, url, p, max_tokens, t0) for p in prompts))
    all_started = max(s["first"] for s in streams)
    end = max(s["last"] for s in streams)
    after = sum(sum(1 for t in s["events"] if t > all_started) for s in streams)
    return {"wall_s": end, "ttft_median_s": statistics.median(s["first"] for s in streams),
            "ttft_max_s": all_started, "decode_tok_s": after / (end - all_started) if end > all_started else None,
            "events": sum(len(s["events"]) for s in streams)}


def conveyor_cmd(root: Path, file: str, args: argparse.Namespace, port: int) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(root)!r}); from conveyor.cli import main; "
            "sys.exit(main())", "serve", "--model", file, "--parallel", str(args.concurrency), "--speculative-ngram",
            "0", "--ctx-size", str(args.concurrency * (args.prompt_tokens + args.max_tokens + 64)), "--threads",
            str(args.threads), "--host", "127.0.0.1", "--port", str(port), *args.conveyor_args.split()]


def llama_cmd(args: argparse.Namespace, port: int) -> list[str]:
    return [args.llama_server, "-m", args.file, "-np", str(args.concurrency), "-c",
            str(args.concurrency * (args.prompt_tokens + args.max_tokens + 64)), "-t", str(args.threads), "--host",
            "127.0.0.1", "--port", str(port)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file")
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--base", help="another checkout of conveyor, run beside this one")
    p.add_argument("--llama-server", help="llama-server binary (skipped without one)")
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--conveyor-args", default="", help="more `conveyor serve` flags (both checkouts), as one value: "
                   "--conveyor-args='--cache-type-k q8_0 --cache-type-v q8_0'")
    args = p.parse_args()
    prompts = prompt_ids(args.file, args.prompt_tokens, args.concurrency)
    servers = [("conveyor", lambda port: conveyor_cmd(ROOT, args.file, args, port))]
    if args.base:
        servers.append(("base", lambda port: conveyor_cmd(Path(args.base), args.file, args, port)))
    if args.llama_server:
        servers.append(("llama-server", lambda port: llama_cmd(args, port)))
    results = {}
    for name, make in servers:
        port = free_port()
        with ServerProcess(make(port), port, log=Path(f"/tmp/shared_prompt_{name}.log"), timeout=900, name=name):
            results[name] = asyncio.run(run_batch(f"http://127.0.0.1:{port}", prompts, args.max_tokens))
        print(name, json.dumps(results[name]), file=sys.stderr, flush=True)
    print(f"{machine()}; {args.threads} threads; {args.concurrency} requests on one {args.prompt_tokens}-token prompt "
          f"(each its own last 8 tokens), {args.max_tokens} tokens each, greedy")
    print("| server | batch wall s | median TTFT s | decode tok/s, all streams running |\n|---|---|---|---|")
    for name, r in results.items():
        rate = f"{r['decode_tok_s']:.1f}" if r["decode_tok_s"] else "-"
        print(f"| {name} | {r['wall_s']:.2f} | {r['ttft_median_s']:.2f} | {rate} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"file": args.file, "cpu": machine(), "args": vars(args),
                                               "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
