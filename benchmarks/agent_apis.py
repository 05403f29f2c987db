"""The agent APIs' cost and their prefix-cache use (issue #39), against a real `conveyor serve`.

    .venv/bin/python benchmarks/agent_apis.py [--rounds 3] [--concurrency 16] [--tokens 96] [--model PATH]

1. Throughput: C concurrent streamed requests of the same conversations, greedy, through
   /v1/chat/completions, /v1/messages and /v1/responses, the three APIs interleaved round by round
   (this VM's speed drifts); output tokens per second of wall time, each API's ratio to chat's. The
   clients are raw httpx streams that read each API's final usage only, so the figure is the server's.
2. Agents: one 4k-token system prompt and tool list, sent first by one agent, then by C-1 more at once
   through /v1/messages: each reply's cache_read_input_tokens and time to first byte.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time

import httpx

TOOLS = [{"name": f"tool_{i}", "description": f"Tool number {i}: reads, edits or runs something in the repo.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"}},
                           "required": ["path"]}} for i in range(12)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _bodies(api: str, question: str, model: str, tokens: int) -> tuple[str, dict]:
    messages = [{"role": "user", "content": question}]
    if api == "chat":
        return "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0,
                                        "stream": True, "stream_options": {"include_usage": True}}
    if api == "messages":
        return "/v1/messages", {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0,
                                "stream": True}
    return "/v1/responses", {"model": model, "input": question, "max_output_tokens": tokens, "temperature": 0,
                             "stream": True, "store": False}


def _output_tokens(api: str, data: dict) -> int | None:
    if api == "chat":
        return (data.get("usage") or {}).get("completion_tokens")
    if api == "messages":
        return data["usage"]["output_tokens"] if data.get("type") == "message_delta" else None
    if data.get("type") in ("response.completed", "response.incomplete"):
        return data["response"]["usage"]["output_tokens"]
    return None


async def _one(client: httpx.AsyncClient, api: str, path: str, body: dict) -> int:
    tokens = None
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and ('usage' in line):
                tokens = _output_tokens(api, json.loads(line[6:])) or tokens
    assert tokens, f"{api}: no usage in the stream"
    return tokens


async def throughput(url: str, model: str, concurrency: int, rounds: int, tokens: int) -> dict:
    questions = [f"Question {i}: explain topic number {i} of operating systems in detail." for i in range(concurrency)]
    totals = {api: [0, 0.0] for api in ("chat", "messages", "responses")}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for api in totals:  # warm-up: every path compiled and cached once
            await _one(client, api, *_bodies(api, "warm up", model, 4))
        for r in range(rounds):
            order = list(totals) if r % 2 == 0 else list(reversed(totals))
            for api in order:
                start = time.perf_counter()
                counts = await asyncio.gather(*(_one(client, api, *_bodies(api, q, model, tokens)) for q in questions))
                totals[api][0] += sum(counts)
                totals[api][1] += time.perf_counter() - start
    rates = {api: n / s for api, (n, s) in totals.items()}
    return {api: {"tokens": totals[api][0], "seconds": round(totals[api][1], 2), "tok_s": round(rate, 1),
                  "vs_chat": round(rate / rates["chat"], 3)} for api, rate in rates.items()}


async def shared_prefix(url: str, model: str, concurrency: int, prefix_tokens: int) -> dict:
    rules = " ".join(f"Rule {i}: keep each edit small, test it, and say what changed." for i in range(prefix_tokens // 16))
    system = "You are a coding agent working in a repository. " + rules

    def body(i: int) -> dict:
        return {"model": model, "system": system, "tools": TOOLS, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": f"Task {i}: fix the failing test number {i}."}]}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        count = (await client.post("/v1/messages/count_tokens", json=body(0))).json()["input_tokens"]

        async def send(i: int) -> dict:
            start = time.perf_counter()
            r = await client.post("/v1/messages", json=body(i))
            assert r.status_code == 200, r.text
            return {**r.json()["usage"], "seconds": round(time.perf_counter() - start, 3)}
        first = await send(0)
        rest = await asyncio.gather(*(send(i) for i in range(1, concurrency)))
    return {"prompt_tokens": count, "first": first, "rest_cache_read": [u["cache_read_input_tokens"] for u in rest],
            "rest_mean_seconds": round(sum(u["seconds"] for u in rest) / len(rest), 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2)")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()

    port = _free_port()
    cmd = [sys.executable, "-m", "conveyor.cli", "serve", "--port", str(port), "--parallel", str(args.concurrency)]
    if args.model:
        cmd += ["--model", args.model]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        results = {"cpu": _cpu(), "cpus": os.cpu_count(), "model": model, "concurrency": args.concurrency,
                   "tokens": args.tokens, "rounds": args.rounds}
        results["throughput"] = asyncio.run(throughput(url, model, args.concurrency, args.rounds, args.tokens))
        results["shared_prefix"] = asyncio.run(shared_prefix(url, model, args.concurrency, args.prefix_tokens))
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
