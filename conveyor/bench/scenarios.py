"""Scenarios that time one specific interaction rather than a load level.

long-prompt-admission: while N streams decode, one long prompt arrives. A scheduler that
prefills it in one go stalls every stream for the whole prefill; chunked prefill keeps the
streams' inter-token latency flat. We measure the streams' gaps inside the admission window
(the long request's send .. its first token) against their gaps overall.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

import httpx

from conveyor.bench.client import RequestRecord, RequestSpec, Target, send_request
from conveyor.bench.stats import Percentiles
from conveyor.bench.workload import Workload, synthetic_prompts

SCENARIOS = ("long-prompt-admission",)
STREAMS_STREAM, LONG_PROMPT_STREAM = 2000, 2001  # prompt streams distinct from the sweep's
_LONG_MAX_TOKENS = 16  # only its TTFT matters; a few tokens show it decodes afterwards too


@dataclass(frozen=True)
class AdmissionResult:
    num_streams: int
    long_prompt_tokens: int
    long_ttft_ms: float | None  # None when the long request failed
    num_window_gaps: int  # stream gaps that overlap the admission window
    window_itl_ms: Percentiles
    overall_itl_ms: Percentiles
    errors: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.errors and self.long_ttft_ms is not None

    def to_markdown(self) -> str:
        ttft = f"{self.long_ttft_ms:.1f}" if self.long_ttft_ms is not None else "failed"
        w, o = self.window_itl_ms, self.overall_itl_ms
        lines = [
            f"## Long-prompt admission: {self.num_streams} streams + one ~{self.long_prompt_tokens}-token prompt",
            "",
            "| long TTFT (ms) | window gaps | window ITL p50 (ms) | window ITL p95 (ms) | window ITL max (ms) "
            "| overall ITL p50 (ms) | overall ITL p95 (ms) |",
            "|---:|---:|---:|---:|---:|---:|---:|",
            f"| {ttft} | {self.num_window_gaps} | {w.p50:.1f} | {w.p95:.1f} | {w.max:.1f} "
            f"| {o.p50:.1f} | {o.p95:.1f} |",
        ]
        if self.num_window_gaps == 0:
            lines.append("\nwarning: no stream token fell in the admission window; raise --max-tokens "
                         "(and pass --ignore-eos) so the streams outlive the long prompt's prefill.")
        lines += [f"- error: {e}" for e in self.errors]
        return "\n".join(lines) + "\n"


def _gaps_overlapping(record: RequestRecord, start_s: float, end_s: float) -> list[float]:
    # A gap (a, b] counts when it overlaps [start, end]: a stall that spans the whole prefill included.
    times = record.chunk_times_s
    return [b - a for a, b in zip(times, times[1:]) if b > start_s and a < end_s]


async def long_prompt_admission(
    client: httpx.AsyncClient,
    target: Target,
    workload: Workload,
    num_streams: int,
    long_prompt_tokens: int,
    ready_timeout_s: float = 600.0,
) -> AdmissionResult:
    started = [asyncio.Event() for _ in range(num_streams)]

    async def _stream(spec: RequestSpec, ready: asyncio.Event) -> RequestRecord:
        try:
            return await send_request(client, target, spec, on_first_token=ready.set)
        finally:
            ready.set()  # a stream that fails before its first token must not hang the scenario

    specs = workload.specs(num_streams, STREAMS_STREAM)
    tasks = [asyncio.create_task(_stream(s, e)) for s, e in zip(specs, started, strict=True)]
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), ready_timeout_s)
    except TimeoutError:
        for task in tasks:
            task.cancel()
        raise RuntimeError(f"the {num_streams} streams did not all start within {ready_timeout_s:.0f}s") from None

    (long_text,) = synthetic_prompts(1, long_prompt_tokens, workload.prompts.seed, LONG_PROMPT_STREAM)
    long_spec = dataclasses.replace(specs[0], prompt=long_text, max_tokens=_LONG_MAX_TOKENS)
    long = await send_request(client, target, long_spec)
    streams = await asyncio.gather(*tasks)

    window_end = long.chunk_times_s[0] if long.chunk_times_s else long.end_s
    window = [g for r in streams for g in _gaps_overlapping(r, long.start_s, window_end)]
    errors = [r.error for r in [*streams, long] if r.error]
    ttft = long.ttft_s
    return AdmissionResult(
        num_streams=num_streams,
        long_prompt_tokens=long_prompt_tokens,
        long_ttft_ms=ttft * 1000.0 if ttft is not None and long.ok else None,
        num_window_gaps=len(window),
        window_itl_ms=Percentiles.of(window, 1000.0),
        overall_itl_ms=Percentiles.of([g for r in streams for g in r.itl_s], 1000.0),
        errors=tuple(dict.fromkeys(errors)),
    )
