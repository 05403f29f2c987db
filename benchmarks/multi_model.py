"""Several models in one server (issue #40): what a switch costs, what a load does to the streams of the
model already serving, and what two models served at once give against one.

Usage:
  python benchmarks/multi_model.py [--models-dir /work/bench-models] [--out benchmarks/results.md]

Files (written once under --models-dir, not in the repo): two Llama-3.2-1B-shaped GGUFs (hidden 2048, 16
layers, 32 / 8 heads, FFN 8192, tied embeddings, SmolLM2's tokenizer) in Q4_K_M's mix (Q6_K token
embedding, attn_v and ffn_down; Q4_K the rest), random blocks written directly (no llama-quantize needed:
the bytes a load reads and packs are what a quantized file's are); plus the bundled SmolLM2-135M.

Three measurements, each on a fresh `conveyor serve` with several models:
  switch   --models-max 1 over the two 1B files: A, B, then A again (evicted, its file in the page cache):
           time to the first token of that request, which includes unloading B and loading A.
  load     SmolLM2 streams 4 greedy chats at a time (256 tokens each, one after another); meanwhile the 1B loads (POST /models/load): the
           inter-token gaps of SmolLM2's streams during the load against those before it (p50, p99).
  together C requests of 64 tokens on one 1B model alone, then C/2 on each of the two 1B models at once
           (both loaded): output tokens per second, together / alone.
  preempt  --models-contention preempt, --models-max 1: A streams 200 tokens; a request for B suspends A;
           B's time to first token and A's longest pause (A's whole output equals an undisturbed run: tested).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import gguf
import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CHAT_TOKENS = 256  # each streaming chat of the load measurement
sys.path.insert(0, str(ROOT / "benchmarks"))
from quantized import smollm2_path, write_llama_1b_shape  # noqa: E402  (a sibling script)
from server_process import ServerProcess, free_port  # noqa: E402

from conveyor.testing import random_blocks  # noqa: E402

Q4_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K


# Q4_K_M's mix: Q6_K for the token embedding, attn_v and ffn_down, Q4_K for the rest.
_Q6_K_TENSORS = ("token_embd.weight", ".attn_v.weight", ".ffn_down.weight")


def write_1b_q4_k_m(path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)

    def blocks(writer: gguf.GGUFWriter, name: str, rows: int, cols: int) -> None:
        qtype = Q6_K if name.endswith(_Q6_K_TENSORS) else Q4_K
        writer.add_tensor(name, random_blocks(rows, cols, qtype, rng, 0.02), raw_dtype=qtype)

    write_llama_1b_shape(path, path.stem, gguf.LlamaFileType.MOSTLY_Q4_K_M, blocks)


def ensure_files(folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = (folder / "llama-1b-a-Q4_K_M.gguf", folder / "llama-1b-b-Q4_K_M.gguf")
    for seed, path in enumerate(files):
        if not path.exists():
            print(f"writing {path}", flush=True)
            write_1b_q4_k_m(path, seed)
    return files


class Server(ServerProcess):
    def __init__(self, args: list[str], log: Path) -> None:
        port = free_port()
        super().__init__([sys.executable, "-m", "conveyor.cli", "serve", "--port", str(port), "--no-webui",
                          "--speculative-ngram", "0", *args], port, log,
                         env={**os.environ, "CONVEYOR_REQUIRE_KERNELS": "1"}, timeout=600, name="conveyor")


async def stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One greedy streaming completion: time to first token and the arrival time of every token."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    arrivals = []
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text"):
                    arrivals.append(time.perf_counter())
    return {"ttft": arrivals[0] - start, "arrivals": arrivals, "start": start}


async def measure_switch(files: tuple[Path, Path], folder: Path) -> dict:
    a, b = (f.stem for f in files)
    server = Server(["--model", str(files[0]), "--model", str(files[1]), "--models-max", "1", "--parallel", "4",
                     "--ctx-size", "8192"], folder / "switch.log")
    try:
        async with httpx.AsyncClient() as client:
            first = (await stream(client, server.url, a, "Hello there", 8))["ttft"]  # cold: reads the file
            to_b = (await stream(client, server.url, b, "Hello there", 8))["ttft"]
            back = [(await stream(client, server.url, name, "Hello there", 8))["ttft"] for name in (a, b, a, b)]
            warm = (await stream(client, server.url, b, "Hello there", 8))["ttft"]
            cards = (await client.get(f"{server.url}/v1/models")).json()["data"]
    finally:
        server.stop()
    loads = {c["id"]: c["status"] for c in cards}
    return {"first_load_ttft_s": first, "switch_ttft_s": [to_b, *back], "loaded_ttft_s": warm,
            "memory": {c["id"]: c["memory_bytes"] for c in cards if c["memory_bytes"]}, "states": loads}


def _gaps(streams: list[dict], window: tuple[float, float]) -> list[float]:
    lo, hi = window
    return [t1 - t0 for s in streams for t0, t1 in zip(s["arrivals"], s["arrivals"][1:]) if lo <= t1 <= hi]


async def _chats_until(client: httpx.AsyncClient, url: str, model: str, prompt: str, stop: asyncio.Event) -> list[dict]:
    """Greedy streaming completions of CHAT_TOKENS tokens one after another until `stop` is set. Chats of one
    length keep the contexts' spread alike before and during a load (one long chat steps slower as it grows)."""
    chats = []
    for n in itertools.count():
        chats.append(await stream(client, url, model, f"{prompt} part {n}.", CHAT_TOKENS))
        if stop.is_set():
            return chats


async def measure_load_interference(files: tuple[Path, Path], folder: Path) -> dict:
    smol = str(smollm2_path())
    server = Server(["--model", smol, "--model", str(files[0]), "--models-max", "2", "--parallel", "4",
                     "--ctx-size", "8192"], folder / "load.log")
    try:
        async with httpx.AsyncClient() as client:
            name = Path(smol).stem
            await stream(client, server.url, name, "Warm up", 8)
            stop = asyncio.Event()
            tasks = [asyncio.ensure_future(_chats_until(client, server.url, name, f"Story {i}:", stop))
                     for i in range(4)]
            await asyncio.sleep(8)  # the streams settle: the 'before' window
            t_load = time.perf_counter()
            await client.post(f"{server.url}/models/load", json={"model": files[0].stem}, timeout=600)
            t_loaded = time.perf_counter()
            stop.set()
            streams = [chat for chats in await asyncio.gather(*tasks) for chat in chats]
    finally:
        server.stop()
    before, during = _gaps(streams, (t_load - 6, t_load)), _gaps(streams, (t_load, t_loaded))
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] * 1000  # noqa: E731
    return {"load_s": t_loaded - t_load, "itl_ms_before": {"p50": q(before, 50), "p99": q(before, 99), "n": len(before)},
            "itl_ms_during": {"p50": q(during, 50), "p99": q(during, 99), "n": len(during)},
            "p99_ratio": q(during, 99) / q(before, 99)}


async def measure_together(files: tuple[Path, Path], folder: Path, concurrency: int) -> dict:
    a, b = (f.stem for f in files)
    server = Server(["--model", str(files[0]), "--model", str(files[1]), "--models-max", "2", "--parallel",
                     str(concurrency), "--ctx-size", str(concurrency * 512)], folder / "together.log")
    try:
        async with httpx.AsyncClient() as client:
            for name in (a, b):
                await stream(client, server.url, name, "Warm up", 8)

            async def run(names: list[str]) -> float:
                start = time.perf_counter()
                done = await asyncio.gather(*(stream(client, server.url, n, f"Item {i}:", 64)
                                              for i, n in enumerate(names)))
                return sum(len(d["arrivals"]) for d in done) / (time.perf_counter() - start)

            alone = await run([a] * concurrency)
            together = await run([a, b] * (concurrency // 2))
            alone_again = await run([a] * concurrency)
    finally:
        server.stop()
    one = (alone + alone_again) / 2
    return {"concurrency": concurrency, "alone_tok_s": [alone, alone_again], "together_tok_s": together,
            "ratio": together / one}


async def measure_preempt(files: tuple[Path, Path], folder: Path) -> dict:
    """--models-contention preempt, room for one: A streams; a request for B suspends A (its stream pauses),
    B answers, A comes back and its stream goes on. B's time to first token, and A's longest gap."""
    a, b = (f.stem for f in files)
    server = Server(["--model", str(files[0]), "--model", str(files[1]), "--models-max", "1", "--parallel", "4",
                     "--ctx-size", "8192", "--models-contention", "preempt"], folder / "preempt.log")
    try:
        async with httpx.AsyncClient() as client:
            await stream(client, server.url, a, "Warm up", 8)
            long_a = asyncio.ensure_future(stream(client, server.url, a, "A long story:", 200))
            await asyncio.sleep(3)
            b_reply = await stream(client, server.url, b, "Hello there", 8)
            a_reply = await long_a
            cards = {c["id"]: c for c in (await client.get(f"{server.url}/v1/models")).json()["data"]}
    finally:
        server.stop()
    gaps = [t1 - t0 for t0, t1 in zip(a_reply["arrivals"], a_reply["arrivals"][1:])]
    return {"b_ttft_s": b_reply["ttft"], "a_longest_gap_s": max(gaps), "a_tokens": len(a_reply["arrivals"]),
            "a_unloads": cards[a]["unloads"], "a_state": cards[a]["status"]["value"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models-dir", type=Path, default=Path("/work/bench-models"))
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/multi_model_xeon_amx.json")
    p.add_argument("--only", choices=("switch", "load", "together", "preempt"), help="one measurement (printed only)")
    args = p.parse_args()
    files = ensure_files(args.models_dir)
    logs = args.models_dir / "logs"
    logs.mkdir(exist_ok=True)
    if args.only:
        measure = {"switch": measure_switch, "load": measure_load_interference, "preempt": measure_preempt,
                   "together": lambda f, folder: measure_together(f, folder, args.concurrency)}[args.only]
        print(json.dumps(asyncio.run(measure(files, logs)), indent=1))
        return
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    result = {"cpu": cpu, "cores": os.cpu_count(), "files": [f.name for f in files],
              "file_bytes": [f.stat().st_size for f in files]}
    result["switch"] = asyncio.run(measure_switch(files, logs))
    print(json.dumps(result["switch"], indent=1), flush=True)
    result["load"] = asyncio.run(measure_load_interference(files, logs))
    print(json.dumps(result["load"], indent=1), flush=True)
    result["together"] = asyncio.run(measure_together(files, logs, args.concurrency))
    print(json.dumps(result["together"], indent=1), flush=True)
    result["preempt"] = asyncio.run(measure_preempt(files, logs))
    print(json.dumps(result["preempt"], indent=1), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
