"""Scheduling knobs and the small pure decisions the scheduler makes with them."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from conveyor.engine.request import Request

ADAPTIVE_CHUNK_IDLE = 2048  # nothing decodes: big chunks keep single-stream TTFT
ADAPTIVE_CHUNK_DECODING = 512  # streams are live: small chunks bound their inter-token hiccup


class TickPolicy(str, enum.Enum):
    MIXED = "mixed"  # one forward carries the decode rows plus prefill under a token budget
    ALTERNATE = "alternate"  # a tick is either a decode step or a prefill, with a grant interval


class PreemptionPolicy(str, enum.Enum):
    LONGEST_FIRST = "longest-first"
    LOWEST_PRIORITY = "lowest-priority"


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 4  # sequences in flight (admitted, prefilling or decoding)
    max_model_len: int = 2048  # prompt + generated tokens per sequence
    prefill_chunk_size: int = -1  # -1 adaptive, 0 = whole prompt in one tick, else fixed
    prefill_grant_interval: int = 16  # alternate policy: decode ticks before a parked prefill gets one
    max_batch_prefill: int = 4  # new prompts admitted into one forward
    max_batch_prefill_tokens: int = -1  # -1 derived (2 * max_batch_prefill * min(chunk, 512)), 0 = no cap
    tick_policy: TickPolicy = TickPolicy.ALTERNATE
    enable_preemption: bool = False
    # Seconds of waiting worth one priority level (0 = strict priority); see priority_key.
    priority_aging_s: float = 10.0
    preemption_policy: PreemptionPolicy = PreemptionPolicy.LONGEST_FIRST
    kv_admission_watermark: float = 0.01  # share of the pool kept free at admission while rows decode
    watermark_applies: bool = True  # False when the pool is unbounded (no budget)
    speculative_ngram: int = 0  # draft tokens per decode row (prompt lookup); 0 = off
    speculative_max_rows: int = 16  # decode rows + draft tokens per tick; drafts fill what is left
    prompt_lookup_max_batch: int = 0  # prompt-lookup drafts only while <= N rows decode; 0 = no limit
    draft_model_tokens: int = 0  # draft-model tokens proposed per row (the runner has a draft model); 0 = off

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if self.prefill_chunk_size < -1:
            raise ValueError("prefill_chunk_size must be -1 (adaptive), 0 (off) or positive")
        if self.prefill_grant_interval < 0:
            raise ValueError("prefill_grant_interval must be >= 0")
        if self.max_batch_prefill < 1:
            raise ValueError("max_batch_prefill must be at least 1")
        if self.max_batch_prefill_tokens < -1:
            raise ValueError("max_batch_prefill_tokens must be -1 (derived), 0 (no cap) or positive")
        if self.priority_aging_s < 0:
            raise ValueError("priority_aging_s must be >= 0")
        if not 0.0 <= self.kv_admission_watermark <= 0.5:
            raise ValueError("kv_admission_watermark must be in [0.0, 0.5]")
        object.__setattr__(self, "tick_policy", TickPolicy(self.tick_policy))
        object.__setattr__(self, "preemption_policy", PreemptionPolicy(self.preemption_policy))

    def chunk_size(self, decoding: bool) -> int:
        if self.prefill_chunk_size < 0:
            return ADAPTIVE_CHUNK_DECODING if decoding else ADAPTIVE_CHUNK_IDLE
        return self.prefill_chunk_size or self.max_model_len

    def batch_prefill_token_cap(self, chunk: int) -> int | None:
        if self.max_batch_prefill_tokens == 0:
            return None
        if self.max_batch_prefill_tokens > 0:
            return self.max_batch_prefill_tokens
        # The seeds' derivation: chunk-sized prompts batch fully, a window of longer ones spills to chunks.
        return 2 * self.max_batch_prefill * min(chunk, ADAPTIVE_CHUNK_DECODING)


def prefill_tokens_per_tick(prefill_chunk_size: int, max_batch_prefill: int,
                            max_batch_prefill_tokens: int) -> int | None:
    """The most prompt tokens one tick prefills, as SchedulerConfig's chunk_size and batch_prefill_token_cap
    allow (the head of a batched prefill always goes); None when whole prompts go in one tick."""
    if prefill_chunk_size == 0:
        return None
    chunk = ADAPTIVE_CHUNK_IDLE if prefill_chunk_size < 0 else prefill_chunk_size
    cap = max_batch_prefill_tokens
    if cap < 0:
        cap = 2 * max_batch_prefill * min(chunk, ADAPTIVE_CHUNK_DECODING)
    return max(chunk, cap) if cap else max_batch_prefill * chunk


def priority_key(request: Request, aging_s: float = 0.0) -> tuple[float, float]:
    """Waiting-queue order: highest effective priority first, then arrival (a preempted request keeps
    its place). With aging, effective priority = priority + seconds waited / aging_s.

    Comparing two requests at any one moment, `now` cancels out: a priority-p request ranks as if it
    had arrived p * aging_s seconds earlier. So the key is fixed and the queue stays sorted as time
    passes, and a low-priority request is behind a steady stream of higher ones for at most
    (priority gap) * aging_s seconds.
    """
    if aging_s <= 0:
        return (-request.priority, request.arrival_time)
    return (request.arrival_time - request.priority * aging_s, request.arrival_time)


def pick_arrival_victim(running: Iterable[Request], arrival: Request, policy: PreemptionPolicy) -> Request | None:
    """A running row the arrival may evict: strictly lower priority, chosen by the policy."""
    candidates = [r for r in running if r.priority < arrival.priority]
    if not candidates:
        return None
    if policy == PreemptionPolicy.LOWEST_PRIORITY:
        return min(candidates, key=lambda r: (r.priority, -len(r.output_token_ids)))
    return max(candidates, key=lambda r: (len(r.output_token_ids), -r.priority))


def pick_reclaim_victim(running: Iterable[Request], protected: set[str]) -> Request | None:
    """When a row needs a block and none is free: lowest priority, then least progressed, loses."""
    candidates = [r for r in running if r.request_id not in protected]
    if not candidates:
        return None
    return min(candidates, key=lambda r: (r.priority, r.num_computed_tokens, -r.arrival_time))
