"""One `conveyor bench` run: pick the mode, run it, print and write the report."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from conveyor.bench.client import Target, card_param_count, fetch_first_model, make_client
from conveyor.bench.config import BenchConfig
from conveyor.bench.consistency import check_consistency
from conveyor.bench.report import levels_payload, markdown_table, write_json, write_plot
from conveyor.bench.roofline import Roofline, gflops_per_token_from_params, measure_bf16_gemm_gflops
from conveyor.bench.runner import run_sweep
from conveyor.bench.scenarios import long_prompt_admission
from conveyor.bench.stats import LevelStats

# Exit codes: 0 ran fine; 1 a gate failed (outputs differ, a level or scenario had no success);
# 2 the run could not start (bad flags, server unreachable).
EXIT_OK, EXIT_FAILED, EXIT_UNUSABLE = 0, 1, 2


@dataclass(frozen=True)
class BenchReport:
    markdown: str
    payload: dict[str, Any]  # the JSON document, less the config
    exit_code: int
    levels: list[LevelStats] | None = None  # a sweep's levels, for the plot


def run_bench(cfg: BenchConfig) -> int:
    try:
        report = asyncio.run(_run(cfg))
    except (httpx.HTTPError, OSError, ValueError, RuntimeError) as exc:
        print(f"conveyor bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    print(report.markdown)
    if cfg.output_md:
        Path(cfg.output_md).write_text(report.markdown, encoding="utf-8")
    if cfg.output_json:
        write_json(cfg.output_json, {"created": datetime.now(UTC).isoformat(timespec="seconds"),
                                     "config": _public_config(cfg), **report.payload})
    if cfg.plot and report.levels:
        try:
            write_plot(cfg.plot, report.levels, title=report.payload.get("model", ""))
        except RuntimeError as exc:
            print(f"conveyor bench: {exc}", file=sys.stderr)
            return EXIT_UNUSABLE
    return report.exit_code


async def _run(cfg: BenchConfig) -> BenchReport:
    workload = cfg.workload()  # reads --prompt-file before anything is sent
    # The scenario holds its streams and the long prompt open at once.
    max_connections = max(cfg.max_concurrency, cfg.num_streams + 1)
    async with make_client(cfg.api_key, cfg.timeout_s, max_connections) as client:
        try:
            card = await fetch_first_model(client, cfg.base_url)
        except (httpx.HTTPError, ValueError):
            if cfg.model is None:
                raise
            card = {"id": cfg.model}  # told which model: a server without /v1/models still works
        model = cfg.model or card["id"]
        num_params = card_param_count(card) if card["id"] == model else None
        if cfg.model_gflops_per_token is None and num_params is not None:
            # The server says how big its model is; an explicit --model-params still wins.
            cfg = dataclasses.replace(cfg, model_gflops_per_token=gflops_per_token_from_params(num_params))
        target = Target(cfg.base_url, cfg.endpoint, model)
        if cfg.check_consistency:
            result = await check_consistency(client, target, workload, cfg.num_requests, cfg.max_concurrency,
                                             cfg.progress)
            return BenchReport(result.to_markdown(), {"model": model, "consistency": dataclasses.asdict(result)},
                               EXIT_OK if result.passed else EXIT_FAILED)
        if cfg.scenario == "long-prompt-admission":
            result = await long_prompt_admission(client, target, workload, cfg.num_streams,
                                                 cfg.long_prompt_tokens, cfg.timeout_s)
            return BenchReport(result.to_markdown(), {"model": model, "scenario": dataclasses.asdict(result)},
                               EXIT_OK if result.passed else EXIT_FAILED)
        if cfg.num_requests < cfg.max_concurrency:
            print(f"warning: --num-requests {cfg.num_requests} < concurrency {cfg.max_concurrency}; "
                  "the top levels never reach their concurrency", file=sys.stderr)
        roofline = _roofline(cfg)  # before the sweep, so the GEMM does not compete with the server
        levels = await run_sweep(client, target, workload, list(cfg.concurrency_levels), cfg.num_requests,
                                 request_rate=cfg.request_rate, num_warmup=cfg.num_warmup, seed=cfg.seed,
                                 progress=cfg.progress)
    mode = f"Poisson {cfg.request_rate} req/s" if cfg.request_rate else "closed loop"
    prompts = Path(cfg.prompt_file).name if cfg.prompt_file else f"~{cfg.prompt_tokens} tokens"
    title = f"{model} @ {cfg.base_url} ({cfg.endpoint}, {mode}, prompts {prompts}, max_tokens {cfg.max_tokens})"
    dead = any(s.num_errors == s.num_requests for s in levels)
    return BenchReport(markdown_table(levels, roofline, title), {"model": model, **levels_payload(levels, roofline)},
                       EXIT_FAILED if dead else EXIT_OK, levels)


def _public_config(cfg: BenchConfig) -> dict[str, Any]:
    # Result files get shared; the key must not travel with them.
    return dataclasses.asdict(dataclasses.replace(cfg, api_key="<redacted>" if cfg.api_key else None))


def _roofline(cfg: BenchConfig) -> Roofline | None:
    if cfg.measure_roofline:
        return Roofline(measure_bf16_gemm_gflops(), cfg.model_gflops_per_token, measured=True)
    if cfg.roofline_gflops is not None:
        return Roofline(cfg.roofline_gflops, cfg.model_gflops_per_token)
    return None
