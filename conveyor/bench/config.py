"""Everything one `conveyor bench` run needs, validated once."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from conveyor.bench.client import ENDPOINT_PATHS, normalize_base_url
from conveyor.bench.roofline import gflops_per_token_from_params, parse_param_count
from conveyor.bench.scenarios import SCENARIOS
from conveyor.bench.workload import PromptSource, Workload, load_prompt_file


def parse_levels(text: str) -> tuple[int, ...]:
    """'1,4,16' -> (1, 4, 16)."""
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--concurrency wants comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency levels must be >= 1, got {text!r}")
    return levels


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    endpoint: str = "chat"
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    timeout_s: float = 600.0
    concurrency_levels: tuple[int, ...] = (1, 4, 16, 32)
    num_requests: int = 64
    num_warmup: int = 0
    request_rate: float | None = None  # None: closed loop
    prompt_tokens: int = 256
    prompt_file: str | None = None
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int = 0
    check_consistency: bool = False
    scenario: str | None = None
    num_streams: int = 4
    long_prompt_tokens: int = 2048
    roofline_gflops: float | None = None
    measure_roofline: bool = False
    model_gflops_per_token: float | None = None
    output_json: str | None = None
    output_md: str | None = None
    plot: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"--endpoint must be one of {sorted(ENDPOINT_PATHS)}")
        for name in ("num_requests", "prompt_tokens", "max_tokens", "num_streams", "long_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError("--request-rate must be > 0")
        if self.scenario is not None and self.scenario not in SCENARIOS:
            raise ValueError(f"--scenario must be one of {SCENARIOS}")
        if self.scenario and self.check_consistency:
            raise ValueError("--check-consistency and --scenario are separate runs; pick one")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        gflops_per_token = args.model_gflops_per_token
        if args.model_params is not None:
            gflops_per_token = gflops_per_token_from_params(parse_param_count(args.model_params))
        return cls(
            base_url=normalize_base_url(args.url), endpoint=args.endpoint, model=args.model,
            api_key=args.api_key, timeout_s=args.timeout, concurrency_levels=parse_levels(args.concurrency),
            num_requests=args.num_requests, num_warmup=args.warmup_requests, request_rate=args.request_rate,
            prompt_tokens=args.prompt_tokens, prompt_file=args.prompt_file, max_tokens=args.max_tokens,
            temperature=args.temperature, ignore_eos=args.ignore_eos, seed=args.seed,
            check_consistency=args.check_consistency, scenario=args.scenario, num_streams=args.streams,
            long_prompt_tokens=args.long_prompt_tokens, roofline_gflops=args.roofline_gflops,
            measure_roofline=args.measure_roofline, model_gflops_per_token=gflops_per_token,
            output_json=args.output_json, output_md=args.output_md, plot=args.plot, progress=not args.no_progress,
        )

    @property
    def max_concurrency(self) -> int:
        return max(self.concurrency_levels)

    def workload(self) -> Workload:
        pool = tuple(load_prompt_file(self.prompt_file)) if self.prompt_file else ()
        prompts = PromptSource(num_tokens=self.prompt_tokens, seed=self.seed, pool=pool)
        return Workload(prompts, self.max_tokens, self.temperature, self.ignore_eos)
