"""Iteration-level scheduler: which sequences run this tick, and what their results mean.

Every tick: running sequences first (decode rows, then any unfinished prefill), then
admissions from the queue, all under one token budget. Each request advances through a
single variable, num_computed_tokens, so chunked prefill, prefix hits and re-prefill
after preemption are the same path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from conveyor.engine.kv_cache_manager import KVCacheManager
from conveyor.engine.outputs import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from conveyor.engine.request import Request, RequestStatus


ADAPTIVE_CHUNK_IDLE = 2048
ADAPTIVE_CHUNK_DECODING = 512


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 4  # sequences in flight (admitted, prefilling or decoding)
    max_model_len: int = 2048  # prompt + generated tokens per sequence
    prefill_chunk_size: int = -1  # prompt tokens per tick; -1 = adaptive, 0 = whole prompt in one tick

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if self.prefill_chunk_size < -1:
            raise ValueError("prefill_chunk_size must be -1 (adaptive), 0 (off) or positive")


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_completed: int = 0
    num_prompt_tokens_computed: int = 0
    num_generated_tokens: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._finished_ids: list[str] = []

    # -- queue -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- schedule --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        budget = self._token_budget()
        scheduled: set[str] = set()
        # Running rows first: a decode row costs one token and is never starved by prefill.
        for request in sorted(self.running, key=lambda r: r.status != RequestStatus.DECODING):
            if request not in self.running:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, max(budget, 1))
            if num_new <= 0 or (budget <= 0 and request.status != RequestStatus.DECODING):
                continue
            if not self._reserve(request, num_new, scheduled):
                continue
            out.chunks.append(self._chunk(request, num_new))
            scheduled.add(request.request_id)
            budget -= num_new
        self._admit(out, budget)
        out.block_copies = self.kv.pending_copies
        self.kv.pending_copies = []
        return out

    def prefill_chunk_size(self) -> int:
        chunk = self.config.prefill_chunk_size
        if chunk < 0:  # adaptive: big chunks keep single-stream TTFT, small ones protect live streams
            decoding = any(r.status == RequestStatus.DECODING for r in self.running)
            return ADAPTIVE_CHUNK_DECODING if decoding else ADAPTIVE_CHUNK_IDLE
        return chunk or self.config.max_model_len

    def _token_budget(self) -> int:
        return self.prefill_chunk_size() + self.config.max_batch_size

    def _reserve(self, request: Request, num_new: int, scheduled: set[str]) -> bool:
        """Blocks for num_new more tokens, preempting a not-yet-scheduled row if the pool is dry."""
        while not self.kv.grow(request, request.num_computed_tokens + num_new):
            victim = self._pick_victim(exclude=scheduled | {request.request_id})
            if victim is None:
                return False
            self.preempt(victim)
        return True

    def _pick_victim(self, exclude: set[str]) -> Request | None:
        candidates = [r for r in self.running if r.request_id not in exclude]
        if not candidates:
            return None
        # Least progress loses: it has the least work to redo.
        return min(candidates, key=lambda r: (r.priority, len(r.output_token_ids), -r.arrival_time))

    def preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.QUEUED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size:
            request = self.waiting[0]
            hit = self.kv.find_prefix(request)
            num_new = min(request.num_tokens - hit.num_tokens, budget)
            if not self.kv.admit(request, hit, num_new):
                break  # waits for room; FIFO keeps the order fair
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.PREFILLING
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        tokens = request.all_token_ids[start:start + num_new]
        params = request.sampling_params
        needs_history = params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
        return ScheduledChunk(
            request_id=request.request_id, token_ids=tokens, start_position=start,
            block_table=self.kv.block_table(request.request_id),
            sample=start + num_new == request.num_tokens, sampling_params=params,
            prompt_token_ids=request.prompt_token_ids if needs_history else None,
            output_token_ids=request.output_token_ids if needs_history else None,
        )

    # -- results ---------------------------------------------------------------------------
    def update(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Apply a forward's results; returns the requests that received a token this tick."""
        advanced = []
        for chunk in plan.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.is_finished:
                continue  # aborted while the forward ran
            request.num_computed_tokens += len(chunk.token_ids)
            if request.status == RequestStatus.PREFILLING:
                self.stats.num_prompt_tokens_computed += len(chunk.token_ids)
            self.kv.cache_computed_blocks(request)
            token = result.sampled_token_ids.get(chunk.request_id)
            if not chunk.sample or token is None:
                continue
            request.status = RequestStatus.DECODING
            request.append_output_token(token)
            self.stats.num_generated_tokens += 1
            advanced.append(request)
            status = request.check_stop_token()
            if status is None and request.num_tokens >= self.config.max_model_len:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                self.finish(request.request_id, status)
        return advanced

    def finish(self, request_id: str, status: RequestStatus, error: str | None = None) -> Request | None:
        """Terminal transition from any state; frees the request's blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        request.error = error
        self._finished_ids.append(request_id)
        self.stats.num_completed += 1
        reason = request.finish_reason or "unknown"
        self.stats.finished_by_reason[reason] = self.stats.finished_by_reason.get(reason, 0) + 1
        return request

    def finish_all(self, request_ids: Iterable[str], status: RequestStatus, error: str | None = None) -> list[Request]:
        return [r for rid in list(request_ids) if (r := self.finish(rid, status, error)) is not None]
