"""Serving beside CPU hogs: conveyor and llama-server, quiet and with two `yes > /dev/null` (issue #19).

Usage:
  PYTHONPATH=$PWD python benchmarks/contention.py [--hogs 2] [--concurrency 1,16] [--servers conveyor,llama-server]
                                                  [--file smollm2|PATH.gguf] [--out benchmarks/results.md]

Each server (`conveyor serve --parallel 16 --speculative-ngram 0`, kernels required, and
`llama-server -np 16 -t <cores>`) is started once on the same GGUF file (default: the bundled
SmolLM2-135M, conveyor's default model) and measured with `conveyor bench` (greedy, ignore_eos)
at each concurrency twice: on a quiet machine (the script first waits until other processes use
under --quiet-cpu cores, as benchmarks/quantized.py does), then with --hogs busy processes started
beside the server (no quiet wait: the hogs are the point). The table gives both figures and the
slowdown; the fair share with 2 hogs on 2 cores is half the machine, so the target is <= 2x.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized import (ROOT, _free_port, _measure, _stop, _wait_healthy,  # noqa: E402
                       machine, smollm2_path, wait_quiet)


@dataclass
class Result:
    server: str
    tok_s: dict[tuple[int, int], float] = field(default_factory=dict)  # (hogs, concurrency) -> output tok/s
    errors: dict[tuple[int, int], int] = field(default_factory=dict)
    other_cpu: dict[tuple[int, int], float] = field(default_factory=dict)  # cores used by others (hogs included)
    backend: str = ""
    failure: str | None = None


@contextmanager
def hogs(count: int) -> Iterator[None]:
    procs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def server_command(server: str, path: Path, args: argparse.Namespace, port: int) -> list[str]:
    ctx = str(args.parallel * args.ctx)
    if server == "conveyor":
        return [sys.executable, "-m", "conveyor.cli", "serve", "--model", str(path), "--parallel", str(args.parallel),
                "--speculative-ngram", "0", "--ctx-size", ctx, "--host", "127.0.0.1", "--port", str(port)]
    return [args.llama_server, "-m", str(path), "-np", str(args.parallel), "-c", ctx, "-t", str(args.threads),
            "--host", "127.0.0.1", "--port", str(port)]


def measure(result: Result, path: Path, args: argparse.Namespace, log: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "CONVEYOR_REQUIRE_KERNELS": "1"}
    if result.server == "conveyor":
        env.update(kv.split("=", 1) for kv in args.conveyor_env)
    cmd = server_command(result.server, path, args, port)
    print(f"{result.server}: {' '.join(cmd)}", flush=True)
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(url, proc, args.start_timeout)
            if result.server == "conveyor":
                kernels = httpx.get(f"{url}/props", timeout=30).json().get("kernels", {})
                result.backend = f"{kernels.get('backend', '?')}/{kernels.get('arch', '?')}"
            for count in args.hogs_list:
                if count == 0 and args.quiet_cpu > 0:
                    wait_quiet(args.quiet_cpu, args.quiet_timeout)
                with hogs(count):
                    for i, c in enumerate(args.concurrency):
                        key = (count, c)
                        result.tok_s[key], result.errors[key], result.other_cpu[key] = _measure(
                            proc, url, c, i == 0, args, env, f"hogs={count} C={c}")
        except Exception as exc:  # one server failing still leaves the other's figures
            result.failure = f"{type(exc).__name__}: {exc}"
            print(f"  FAILED: {result.failure}; see {log}", flush=True)
        finally:
            _stop(proc)


def table(results: list[Result], args: argparse.Namespace, path: Path) -> list[str]:
    loaded = max(args.hogs_list)
    lines = [f"### Serving beside {loaded} CPU hogs (`benchmarks/contention.py`, {args.tag})", "",
             f"Machine: {machine()}. File: {path.name}; `--parallel {args.parallel}`, {args.max_tokens} tokens per "
             f"request, greedy; llama-server `-t {args.threads}`"
             f"{''.join(f'; conveyor with `{kv}`' for kv in args.conveyor_env)}. Quiet = other processes under {args.quiet_cpu} "
             f"cores before the run; target: slowdown <= 2x (the fair share of {os.cpu_count()} cores).", "",
             "| server | backend | C | quiet tok/s | with hogs tok/s | slowdown | cores used by others (hogs) |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if r.failure:
            lines.append(f"| {r.server} | {r.backend} | - | failed: {r.failure} | | | |")
            continue
        for c in args.concurrency:
            quiet, busy = r.tok_s.get((0, c)), r.tok_s.get((loaded, c))
            slow = f"{quiet / busy:.2f}x" if quiet and busy else "-"
            errors = sum(r.errors.get((h, c), 0) for h in args.hogs_list)
            lines.append(f"| {r.server} | {r.backend or '-'} | {c} | {_f(quiet)} | {_f(busy)} | {slow}"
                         f"{f' ({errors} errors)' if errors else ''} | {r.other_cpu.get((loaded, c), 0):.2f} |")
    return lines


def _f(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", default="smollm2", help="smollm2 (the bundled GGUF) or a .gguf path")
    p.add_argument("--servers", default="conveyor,llama-server", help="comma list of conveyor, llama-server")
    p.add_argument("--hogs", type=int, default=2, help="CPU hogs beside the server in the loaded phase")
    p.add_argument("--concurrency", default="1,16", type=lambda s: [int(c) for c in s.split(",")])
    p.add_argument("--requests", type=int, default=32, help="requests at C > 1 (at least C)")
    p.add_argument("--requests-c1", type=int, default=6, help="requests at C = 1")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each phase's first level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--parallel", type=int, default=16, help="slots of both servers")
    p.add_argument("--ctx", type=int, default=512, help="context per slot")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server -t")
    p.add_argument("--llama-server", default="/work/llama-native/bin/llama-server")
    p.add_argument("--quiet-cpu", type=float, default=0.2,
                   help="before the quiet phase, wait until other processes use fewer cores (0: no wait)")
    p.add_argument("--quiet-timeout", type=float, default=1800.0, help="give up waiting after this many seconds")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--conveyor-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the conveyor server (e.g. OMP_WAIT_POLICY=PASSIVE); repeatable")
    p.add_argument("--out", help="append the markdown table to this file")
    p.add_argument("--tag", default=time.strftime("%Y-%m-%d %H:%M"))
    args = p.parse_args()
    args.hogs_list = [0, args.hogs] if args.hogs else [0]
    return args


def main() -> None:
    args = parse_args()
    path = smollm2_path() if args.file == "smollm2" else Path(args.file)
    results = []
    for server in args.servers.split(","):
        result = Result(server)
        measure(result, path, args, Path(f"/tmp/contention_{server}.log"))
        results.append(result)
    lines = table(results, args, path)
    print("\n".join(lines))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
