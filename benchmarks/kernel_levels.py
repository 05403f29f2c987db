"""The same load on every kernel level this machine can run, in one run (issue: "every machine").

Usage: python benchmarks/kernel_levels.py [--levels native,avx2,torch] [--tag RUN] [--out benchmarks/results.md]

For each level it starts `conveyor serve --parallel 16` with that level's environment, reads its
/props kernels report, runs `conveyor bench` at concurrency 1 and 16 (16 requests x 128 tokens,
~32-token chat prompts, ignore_eos, greedy) and `--check-consistency` at 16, then the offline
engine (benchmarks/offline_throughput.py, batch 1 and 16). Levels:

- native: kernels for this CPU (-march=native);
- avx2:   kernels for x86-64-v3 with torch and oneDNN capped at AVX2 too, i.e. an AVX2 laptop;
- x86-64: the portable kernels (baseline x86-64), torch capped at its default (SSE) level;
- torch:  no C++ kernels (CONVEYOR_DISABLE_KERNEL=1): the fallback a machine without a compiler gets,
          on the uncapped torch build;
- torch-avx2: the same fallback with torch and oneDNN capped at AVX2 (the fallback of an AVX2 laptop).
"""

from __future__ import annotations

import argparse
import json
import re
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from offline_throughput import emit_table, machine
from server_process import free_port as _free_port, wait_healthy as _wait_healthy

ROOT = Path(__file__).resolve().parent.parent
CONVEYOR = str(Path(sys.executable).parent / "conveyor")
LEVEL_ENV = {
    "native": {"CONVEYOR_KERNEL_ARCH": "native"},
    "avx2": {"CONVEYOR_KERNEL_ARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "x86-64": {"CONVEYOR_KERNEL_ARCH": "x86-64", "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "torch": {"CONVEYOR_DISABLE_KERNEL": "1"},
    "torch-avx2": {"CONVEYOR_DISABLE_KERNEL": "1", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def serve_level(level: str, env: dict[str, str], out_dir: Path, tag: str, peer: str | None = None) -> dict:
    """Bench one server: conveyor at `level`, or a llama-server binary (`peer`) on the same GGUF."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    if peer is None:
        cmd = [CONVEYOR, "serve", "--parallel", "16", "--port", str(port)]
    else:
        from conveyor.loading import default_model_path

        cmd = [peer, "-m", str(default_model_path()), "--parallel", "16", "-c", str(16 * 2048), "--port", str(port),
               "-t", str(os.cpu_count())]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(url, server)
        kernels = (httpx.get(f"{url}/props").json()["kernels"] if peer is None else
                   {"backend": "llama.cpp", "arch": Path(peer).parent.parent.name, "batch_invariant": "-",
                    "speculation": "-"})
        out_json = out_dir / f"levels_{tag}_{level}.json"
        common = ["--url", url, "--num-requests", "16", "--prompt-tokens", "32", "--max-tokens", "128",
                  "--no-progress"]
        subprocess.run([CONVEYOR, "bench", *common, "--concurrency", "1,16", "--ignore-eos", "--warmup-requests", "2",
                        "--output-json", str(out_json)], check=True, env=env, stdout=subprocess.DEVNULL)
        check = subprocess.run([CONVEYOR, "bench", *common, "--concurrency", "1,16", "--check-consistency"],
                               env=env, capture_output=True, text=True)
        found = re.search(r"(\d+/\d+) outputs byte-identical", check.stdout)
        identical = f"{found.group(1)} identical" if found else f"check failed (exit {check.returncode})"
        levels = {lv["concurrency"]: lv for lv in json.loads(out_json.read_text())["levels"]}
        return {"kernels": kernels, "levels": levels, "consistency": identical, "consistency_rc": check.returncode}
    finally:
        server.terminate()
        server.wait(timeout=60)


def offline_level(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/offline_throughput.py"), "--batches", "1,16"],
                         env=env, capture_output=True, text=True, check=True)
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 16 |")]
    return " / ".join(row.split("|")[2].strip() for row in rows)  # decode tok/s at batch 1 / 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="native,avx2,torch")
    parser.add_argument("--tag", default=time.strftime("%Y%m%d_%H%M"))
    parser.add_argument("--no-offline", action="store_true")
    parser.add_argument("--peer", action="append", default=[], metavar="LABEL=PATH",
                        help="also bench a llama-server binary on the same GGUF (e.g. llama-avx2=/path/llama-server)")
    parser.add_argument("--out", default=None, help="append the markdown table to this file")
    args = parser.parse_args()
    out_dir = ROOT / "benchmarks/results"
    rows = []
    runs = [(level, None) for level in args.levels.split(",")] + [tuple(p.split("=", 1)) for p in args.peer]
    for level, peer in runs:
        env = {**os.environ, **LEVEL_ENV.get(level, {})}
        served = serve_level(level, env, out_dir, args.tag, peer)
        offline = "-" if args.no_offline or peer else offline_level(env)
        c1, c16 = served["levels"][1], served["levels"][16]
        k = served["kernels"]
        rows.append([level, f"{k['backend']} / {k['arch']}", str(k["batch_invariant"]).lower(),
                     str(k["speculation"]).lower(), f"{c1['output_tok_s']:.1f}", f"{c16['output_tok_s']:.1f}",
                     f"{c16['ttft_ms']['p50']:.0f}", served["consistency"], offline])
        print(" | ".join(rows[-1]), flush=True)
    caption = (f"Kernel levels, run {args.tag}. Machine: {machine()}. Server: `conveyor serve --parallel 16`; "
               "bench: 16 requests x 128 tokens, ~32-token chat prompts, ignore_eos, greedy; offline: "
               "benchmarks/offline_throughput.py decode tok/s at batch 1 / 16 (no speculation)")
    emit_table(caption, ["level", "backend / arch", "invariant", "speculation", "HTTP c=1 tok/s", "HTTP c=16 tok/s",
                         "TTFT p50 c=16 ms", "c=16 vs c=1 greedy", "offline b1 / b16 tok/s"], rows, args.out)


if __name__ == "__main__":
    main()
