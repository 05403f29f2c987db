"""One long prompt's time to first token: conveyor (this checkout), conveyor at another checkout (--base, e.g. a
`git worktree` of the commit before a kernel change) and llama-server, the same token ids, in one run, interleaved.

conveyor: the offline engine in its own process (prefix cache off, the adaptive chunk, 2 threads), wall time of
generate(max_tokens=1) after a warm-up. llama-server: `-t THREADS -np 1 -c 8192`, one warm-up request, then per
round a `/completion` of the same ids with `n_predict: 1, cache_prompt: false`, wall time of the request.

  flock -x /tmp/bench.lock python benchmarks/prefill_ttft_vs_llama.py FILE.gguf --tokens 1500 --rounds 2 \
      [--base /tmp/wt_base] [--llama-server PATH] [--json benchmarks/results/x.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from server_process import ServerProcess, free_port  # a sibling script

ROOT = Path(__file__).resolve().parent.parent
LLAMA = "/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build-noamx/bin/llama-server"


def prompt_ids(llm, tokens: int) -> list[int]:
    text = open(os.path.join(os.path.dirname(os.__file__), "LICENSE.txt")).read()
    ids = llm.engine.tokenizer.encode(text)
    return (ids * (tokens // len(ids) + 1))[:tokens]


def child(path: str, tokens: int, root: str, ids_out: str | None) -> float:
    sys.path.insert(0, root)  # this checkout's or the base's conveyor (ahead of the editable install)
    from conveyor.engine.llm import LLM
    from conveyor.engine.sampling_params import SamplingParams
    llm = LLM(model=path, parallel=1, ctx_size=8192, enable_prefix_caching=False, kv_cache_budget="none")
    ids = prompt_ids(llm, tokens)
    if ids_out:
        Path(ids_out).write_text(json.dumps(ids))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([ids[:64]], [params])  # warm-up: kernels loaded, pools touched
    start = time.perf_counter()
    llm.generate([ids], [params])
    return time.perf_counter() - start


def run_conveyor(file: str, tokens: int, root: Path, ids_out: str | None = None) -> float:
    cmd = [sys.executable, __file__, file, "--child", str(tokens), "--root", str(root)]
    if ids_out:
        cmd += ["--ids-out", ids_out]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=root)
    return json.loads(out.stdout.strip().splitlines()[-1])


def post(port: int, body: dict) -> float:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
    return time.perf_counter() - start


class LlamaServer(ServerProcess):
    def __init__(self, binary: str, file: str, threads: int):
        port = free_port()
        super().__init__([binary, "-m", file, "-t", str(threads), "-np", "1", "-c", "8192", "--port", str(port)],
                         port, timeout=300)

    def ttft(self, ids: list[int]) -> float:
        return post(self.port, {"prompt": ids, "n_predict": 1, "cache_prompt": False})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("file")
    p.add_argument("--tokens", type=int, default=1500)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--base", help="another checkout of conveyor to time beside this one")
    p.add_argument("--llama-server", default=LLAMA)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the times here")
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    p.add_argument("--ids-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.file, args.child, args.root, args.ids_out)))
        return
    ids_path = f"/tmp/prefill_ttft_ids_{os.getpid()}.json"
    times: dict[str, list[float]] = {"conveyor": [], "base": [], "llama-server": []}
    times["conveyor"].append(run_conveyor(args.file, args.tokens, ROOT, ids_path))
    print("conveyor", f"{times['conveyor'][-1]:.2f} s", file=sys.stderr, flush=True)
    ids = json.loads(Path(ids_path).read_text())
    os.unlink(ids_path)
    server = LlamaServer(args.llama_server, args.file, args.threads) if args.llama_server else None
    try:
        if server:
            server.ttft(ids[:64])  # warm-up
        for r in range(args.rounds):
            if server:
                times["llama-server"].append(server.ttft(ids))
                print("llama-server", f"{times['llama-server'][-1]:.2f} s", file=sys.stderr, flush=True)
            if args.base:
                times["base"].append(run_conveyor(args.file, args.tokens, Path(args.base)))
                print("base", f"{times['base'][-1]:.2f} s", file=sys.stderr, flush=True)
            if r > 0:
                times["conveyor"].append(run_conveyor(args.file, args.tokens, ROOT))
                print("conveyor", f"{times['conveyor'][-1]:.2f} s", file=sys.stderr, flush=True)
    finally:
        if server:
            server.stop()
    med = {k: statistics.median(v) for k, v in times.items() if v}
    print(f"| {args.tokens} tokens | median TTFT s (tok/s) | runs |\n|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.2f} ({args.tokens / v:.0f}) | {', '.join(f'{t:.2f}' for t in times[k])} |")
    if "llama-server" in med:
        for k in ("conveyor", "base"):
            if k in med:
                print(f"{k}: {med['llama-server'] / med[k]:.2f}x llama-server")
    if args.json:
        Path(args.json).write_text(json.dumps({"file": args.file, "tokens": args.tokens, "threads": args.threads,
                                               "times_s": times, "median_s": med}, indent=1) + "\n")


if __name__ == "__main__":
    main()
