"""`conveyor bench`: load-test any OpenAI-compatible server (conveyor, vLLM, llama-server, SGLang).

Only argparse is imported at module level: `conveyor serve` builds this parser too and should not
pay for httpx or tqdm.
"""

from __future__ import annotations

import argparse
import sys


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    # Only show defaults that say something; "(default: None)" is noise.
    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark a running OpenAI-compatible server",
        description="Stream requests to an OpenAI-compatible server at several concurrency levels and report "
        "throughput and TTFT/ITL/E2E latency percentiles. See docs/bench.md.",
        formatter_class=_HelpFormatter,
    )
    target = parser.add_argument_group("server")
    target.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (with or without /v1)")
    target.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                        help="/v1/chat/completions or /v1/completions")
    target.add_argument("--model", help="model name to send (default: first id from GET /v1/models)")
    target.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    target.add_argument("--timeout", type=float, default=600.0, help="per-request connect/read timeout (s)")

    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", default="1,4,16,32", help="comma-separated levels (max in flight)")
    load.add_argument("--num-requests", type=int, default=64, help="requests per level")
    load.add_argument("--request-rate", type=float, help="Poisson arrivals per second (default: closed loop)")
    load.add_argument("--warmup-requests", type=int, default=0, help="unmeasured requests before the first level")
    load.add_argument("--seed", type=int, default=0, help="seeds prompts and Poisson arrivals")

    work = parser.add_argument_group("requests")
    prompt = work.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-tokens", type=int, default=256, help="synthetic prompts of about N tokens")
    prompt.add_argument("--prompt-file", help="take prompts from this file (paragraphs, else lines)")
    work.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request")
    work.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (vLLM, SGLang, llama-server)")
    work.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")

    modes = parser.add_argument_group("modes (instead of the concurrency sweep)")
    modes.add_argument("--check-consistency", action="store_true",
                       help="greedy outputs at concurrency 1 vs the highest level must be byte-identical "
                       "(exit 1 if not)")
    modes.add_argument("--scenario", choices=("long-prompt-admission",),
                       help="streams decode while one long prompt is admitted; report their ITL in that window")
    modes.add_argument("--streams", type=int, default=4, help="decoding streams in the scenario")
    modes.add_argument("--long-prompt-tokens", type=int, default=2048, help="length of the scenario's long prompt")

    roof = parser.add_argument_group("roofline")
    gflops = roof.add_mutually_exclusive_group()
    gflops.add_argument("--roofline-gflops", type=float, help="achievable matmul GFLOP/s of the server's device")
    gflops.add_argument("--measure-roofline", action="store_true",
                        help="time a bf16 [32,576]x[576,1536] GEMM with torch on this machine instead")
    per_token = roof.add_mutually_exclusive_group()
    per_token.add_argument("--model-gflops-per-token", type=float, help="model forward GFLOPs per token")
    per_token.add_argument("--model-params", help="parameter count (e.g. 135M, 1.5B); GFLOPs/token = 2*N/1e9")

    out = parser.add_argument_group("output")
    out.add_argument("--output-json", help="write config and results as JSON")
    out.add_argument("--output-md", help="write the markdown report")
    out.add_argument("--plot", help="PNG of throughput and latency vs concurrency (needs matplotlib)")
    out.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from conveyor.bench.config import BenchConfig
    from conveyor.bench.session import EXIT_UNUSABLE, run_bench

    try:
        cfg = BenchConfig.from_args(args)
    except ValueError as exc:
        print(f"conveyor bench: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    return run_bench(cfg)
