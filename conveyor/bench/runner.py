"""Drive a list of requests at one concurrency level: closed loop or Poisson arrivals."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from conveyor.bench.client import RequestRecord, RequestSpec, Target, send_request
from conveyor.bench.stats import LevelStats, compute_level_stats
from conveyor.bench.workload import Workload

WARMUP_STREAM = 0  # prompt stream of the warm-up requests; level i uses stream i + 1


@dataclass(frozen=True)
class LevelResult:
    records: list[RequestRecord]  # in the order of the specs
    wall_s: float  # first send to last completion


async def run_level(
    client: httpx.AsyncClient,
    target: Target,
    specs: list[RequestSpec],
    concurrency: int,
    request_rate: float | None = None,
    seed: int = 0,
    progress: bool = True,
    desc: str = "",
) -> LevelResult:
    """Send every spec with at most `concurrency` in flight.

    Closed loop (`request_rate=None`): a finished request immediately frees its slot for the next,
    like `concurrency` users that each send again as soon as they are answered.
    Poisson: requests arrive with exponential gaps of mean 1/rate; `concurrency` caps those in
    flight, and time spent waiting for a slot is not counted in TTFT (it is not the server's).
    """
    slots = asyncio.Semaphore(concurrency)
    records: list[RequestRecord | None] = [None] * len(specs)
    bar = tqdm(total=len(specs), desc=desc or f"c={concurrency}", unit="req", disable=not progress)

    async def _one(index: int) -> None:
        async with slots:
            records[index] = await send_request(client, target, specs[index])
        bar.update(1)

    start = time.perf_counter()
    try:
        if request_rate is None:
            await asyncio.gather(*(_one(i) for i in range(len(specs))))
        else:
            await _poisson(_one, len(specs), request_rate, random.Random(seed))
    finally:
        bar.close()
    wall_s = time.perf_counter() - start
    return LevelResult(records=[r for r in records if r is not None], wall_s=wall_s)


async def _poisson(send: Callable[[int], Awaitable[None]], num_requests: int, rate: float, rng: random.Random) -> None:
    tasks = []
    for index in range(num_requests):
        if index:
            await asyncio.sleep(rng.expovariate(rate))
        tasks.append(asyncio.create_task(send(index)))
    await asyncio.gather(*tasks)


async def run_sweep(
    client: httpx.AsyncClient,
    target: Target,
    workload: Workload,
    concurrency_levels: list[int],
    num_requests: int,
    *,
    request_rate: float | None = None,
    num_warmup: int = 0,
    seed: int = 0,
    progress: bool = True,
) -> list[LevelStats]:
    """Run `num_requests` fresh prompts at each concurrency level, after optional warm-up requests."""
    if num_warmup:
        warmup = await run_level(client, target, workload.specs(num_warmup, WARMUP_STREAM),
                                 max(concurrency_levels), progress=progress, desc="warm-up")
        if not any(r.ok for r in warmup.records):
            print(f"warning: every warm-up request failed: {warmup.records[0].error}", file=sys.stderr)
    levels = []
    for index, concurrency in enumerate(concurrency_levels):
        # Fresh prompts per level, so a prefix cache cannot carry one level's work into the next.
        specs = workload.specs(num_requests, WARMUP_STREAM + 1 + index)
        result = await run_level(client, target, specs, concurrency, request_rate, seed + index, progress)
        levels.append(compute_level_stats(result.records, result.wall_s, concurrency, request_rate))
    return levels
