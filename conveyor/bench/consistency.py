"""Greedy outputs must not depend on batching: same prompts at concurrency 1 and at the top level."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import httpx

from conveyor.bench.client import Target
from conveyor.bench.runner import run_level
from conveyor.bench.workload import Workload

CONSISTENCY_STREAM = 1000  # prompt stream distinct from the sweep's
_MAX_SHOWN = 3


@dataclass(frozen=True)
class Mismatch:
    index: int
    offset: int  # first differing character
    single: str  # text around `offset` at concurrency 1
    batched: str  # the same span at the high concurrency


@dataclass(frozen=True)
class ConsistencyResult:
    concurrency: int
    num_prompts: int
    num_identical: int
    num_errors: int  # requests that failed at either level
    mismatches: tuple[Mismatch, ...]
    error_samples: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.num_identical == self.num_prompts

    def to_markdown(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        lines = [
            f"## Consistency: concurrency 1 vs {self.concurrency} (temperature 0)",
            "",
            f"**{verdict}**: {self.num_identical}/{self.num_prompts} outputs byte-identical, "
            f"{len(self.mismatches)} differ, {self.num_errors} errored.",
        ]
        for m in self.mismatches[:_MAX_SHOWN]:
            lines.append(f"- prompt {m.index}, first difference at char {m.offset}: "
                         f"c=1 {m.single!r} vs c={self.concurrency} {m.batched!r}")
        lines += [f"- error: {e}" for e in self.error_samples[:_MAX_SHOWN]]
        return "\n".join(lines) + "\n"


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _mismatch(index: int, single: str, batched: str) -> Mismatch:
    offset = _first_difference(single, batched)
    span = slice(max(0, offset - 10), offset + 30)
    return Mismatch(index, offset, single[span], batched[span])


async def check_consistency(
    client: httpx.AsyncClient,
    target: Target,
    workload: Workload,
    num_prompts: int,
    concurrency: int,
    progress: bool = True,
) -> ConsistencyResult:
    greedy = dataclasses.replace(workload, temperature=0.0)
    specs = greedy.specs(num_prompts, CONSISTENCY_STREAM)
    single = await run_level(client, target, specs, 1, progress=progress, desc="consistency c=1")
    batched = await run_level(client, target, specs, concurrency, progress=progress,
                              desc=f"consistency c={concurrency}")
    mismatches, errors = [], []
    for index, (a, b) in enumerate(zip(single.records, batched.records, strict=True)):
        if not (a.ok and b.ok):
            errors.append(a.error or b.error or "")
        elif a.text != b.text:
            mismatches.append(_mismatch(index, a.text, b.text))
    num_identical = len(specs) - len(mismatches) - len(errors)
    return ConsistencyResult(concurrency, len(specs), num_identical, len(errors),
                             tuple(mismatches), tuple(dict.fromkeys(errors)))
