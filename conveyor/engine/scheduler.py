"""Iteration-level scheduler: which sequences run this tick, and what their results mean.

Each request advances through one variable, num_computed_tokens, so chunked prefill,
prefix hits and re-prefill after preemption share one path. A tick is built by the
policy (see scheduling_policy.py):

  mixed      decode rows + [parked prefill chunk | new admissions]  under one chunk budget
  alternate  decode rows only, or prefill only; a parked prefill is granted a tick after
             prefill_grant_interval consecutive decode ticks
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conveyor.engine.kv_cache_manager import KVCacheManager
from conveyor.engine.ngram_proposer import NgramProposer
from conveyor.engine.outputs import DraftRequest, ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from conveyor.engine.request import Request, RequestStatus
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.scheduling_policy import (SchedulerConfig, TickPolicy, pick_arrival_victim, pick_reclaim_victim,
                                               priority_key)

if TYPE_CHECKING:
    from conveyor.multimodal.vision import ImageItem

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats"]

# A request whose drafts keep missing retries after 1, 3, 7, ... ticks, at most every 2^6 - 1 = 63.
MAX_SPEC_BACKOFF_EXP = 6
# A model drafter's (draft model, MTP, EAGLE3, DFlash) misses are rarely in runs: a trained MTP head right on ~3 of 4
# first drafts loses a whole round ~1 time in 4, and skipping the next tick cost more than the rounds it saved
# (benchmarks/results.md, issue #43). Its back-off starts at this many straight misses; n-gram lookups' at the first.
MODEL_DRAFT_MISSES_BEFORE_BACKOFF = 2


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_reclaim_passes: int = 0  # a running row needed a block and a victim had to give way
    num_prefill_grants: int = 0  # alternate policy: ticks granted to a parked prefill over live decode
    num_mixed_steps: int = 0  # forwards carrying decode rows and prefill together
    num_decode_steps: int = 0
    num_prefill_steps: int = 0
    num_completed: int = 0
    num_prompt_tokens_computed: int = 0
    num_generated_tokens: int = 0
    num_draft_tokens: int = 0  # speculative tokens proposed (prompt lookup) and scored
    num_accepted_tokens: int = 0  # of those, the ones the model's greedy choice confirmed
    num_model_draft_tokens: int = 0  # the draft model's share of num_draft_tokens
    num_model_accepted_tokens: int = 0  # ... and of num_accepted_tokens
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    # Per finish reason, the prompt and output tokens of the requests that finished with it (counted
    # once, in finish()): what the clients' usage blocks add up to.
    prompt_tokens_by_reason: dict[str, int] = field(default_factory=dict)
    generation_tokens_by_reason: dict[str, int] = field(default_factory=dict)


# Called for every token appended to a request, in order; True when a stop string ends the text there.
StopChecker = Callable[[Request, int], bool]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, stop_checker: StopChecker | None = None,
                 draft_length: Callable[[int, bool], int] | None = None) -> None:
        self.config = config
        self.kv = kv
        self.stop_checker = stop_checker
        # Draft-model speculation at this many decode rows? (the adaptive policy; None = always)
        self.draft_length = draft_length  # (batch size, measured tick) -> drafts per row (adaptive policy); None: K
        # Vision models: whether an image's tower output is ready (encoded off the step loop); None = always.
        self.image_ready: Callable[[ImageItem], bool] | None = None
        self.waiting: list[Request] = []  # kept sorted by _queue_key (priority, aged by waiting time)
        self._queue_key = functools.partial(priority_key, aging_s=config.priority_aging_s)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._finished_ids: list[str] = []
        self._decode_ticks_since_prefill = 0
        self.proposer = NgramProposer()
        # Most prompt tokens the next tick takes, below the configured chunk (None: no cap). A background
        # engine sets it while streaming engines share the cores (engine/compute_share.py).
        self.step_token_cap: int | None = None

    # -- queue -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=self._queue_key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running) or self.kv.disk_reads_pending

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- schedule --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.kv.reap_disk_reads()  # prefix blocks read from disk since the last tick join the cache first
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        decode_rows = sorted((r for r in self.running if _is_decode_row(r)),
                             key=lambda r: (-r.priority, -r.num_computed_tokens))
        parked = [r for r in self.running if not _is_decode_row(r)]
        chunk = self.config.chunk_size(decoding=bool(decode_rows))
        if self.step_token_cap is not None:
            chunk = max(1, min(chunk, self.step_token_cap))
        if self.config.tick_policy == TickPolicy.MIXED:
            self._schedule_rows(out, decode_rows, budget=None)
            self._schedule_rows(out, parked, budget=chunk)
            if not parked:
                self._admit(out, chunk, decoding=bool(decode_rows))
        else:
            self._schedule_alternate(out, decode_rows, parked, chunk)
        if self.config.speculative_ngram or self.config.draft_model_tokens:
            self._add_drafts(out)
        if self.kv.states is not None:
            self._plan_states(out)
        self._count_step(out)
        out.block_copies = self.kv.pending_copies
        self.kv.pending_copies = []
        if self.kv.pending_window_copies:
            out.window_block_copies = self.kv.pending_window_copies
            self.kv.pending_window_copies = []
        return out

    def _plan_states(self, out: SchedulerOutput) -> None:
        """Hybrid models: each chunk's state slot, the prefix snapshots it takes, and for a chunk with drafts
        the slot that keeps the state after its real token (restored in update() if a draft misses)."""
        for chunk in out.chunks:
            request = self.requests[chunk.request_id]
            chunk.state_slot = self.kv.state_slot(chunk.request_id)
            real_tokens = len(chunk.token_ids) - chunk.num_draft_tokens
            if chunk.num_draft_tokens or chunk.draft is not None:
                chunk.rollback_slot = self.kv.states.allocate_scratch()
                if chunk.rollback_slot is None:  # no room to roll back: no drafts this tick
                    chunk.token_ids, chunk.num_draft_tokens, chunk.draft = chunk.token_ids[:real_tokens], 0, None
                else:
                    chunk.state_snapshots.append((1, chunk.rollback_slot))
                    if chunk.draft is not None:  # a model drafter's (the pool holds slots for those, not lookup's)
                        self._plan_draft_states(chunk)
            at, pending = self.kv.plan_snapshots(request, chunk.start_position, real_tokens)
            chunk.state_snapshots += at
            out.pending_snapshots += pending
        out.state_copies = self.kv.pending_state_copies
        self.kv.pending_state_copies = []

    def _plan_draft_states(self, chunk: ScheduledChunk) -> None:
        """The state after each draft but the last (the live state is that one), into spare scratch slots: on a
        miss after accepted drafts update() restores it, where recomputing them would cost a tick that cannot
        draft. Slots the pool cannot spare are left out (those drafts are recomputed, as before)."""
        num_drafts = chunk.draft.num_tokens
        slots = []
        for count in range(2, num_drafts + 1):  # rows processed: the real token and count - 1 drafts
            slot = self.kv.states.allocate_spare()
            if slot is None:
                break
            slots.append(slot)
            chunk.state_snapshots.append((count, slot))
        chunk.draft_state_slots = tuple(slots)

    def _schedule_alternate(self, out: SchedulerOutput, decode_rows: list[Request], parked: list[Request],
                            chunk: int) -> None:
        interval = self.config.prefill_grant_interval
        if parked:
            if decode_rows and (interval == 0 or self._decode_ticks_since_prefill < interval):
                self._schedule_rows(out, decode_rows, budget=None)
                self._decode_ticks_since_prefill += 1
                return
            if decode_rows:
                self.stats.num_prefill_grants += 1
            self._schedule_rows(out, parked[:1], budget=chunk)
            self._decode_ticks_since_prefill = 0
            return
        if self.waiting:
            self._admit(out, chunk, decoding=bool(decode_rows))
            if out.chunks:
                self._decode_ticks_since_prefill = 0
                return
        self._schedule_rows(out, decode_rows, budget=None)

    def _schedule_rows(self, out: SchedulerOutput, rows: list[Request], budget: int | None) -> int:
        """Schedule running rows (decode: 1 token each; prefill: up to budget); returns what budget is left."""
        for request in rows:
            if request not in self.running:
                continue  # preempted to make room earlier in this tick
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = remaining if budget is None else min(remaining, budget)
            if request.images:  # never end inside a bidirectional image run; wait for the tower
                start = request.num_computed_tokens
                num_new = request.whole_run_end(start, start + num_new) - start
                if not self._images_ready(request, start):
                    continue
            if num_new <= 0 or not self._reserve(request, num_new, out):
                continue
            out.chunks.append(self._chunk(request, num_new))
            if budget is not None:
                budget -= num_new
        return budget or 0

    def _reserve(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Blocks for num_new more tokens. If the pool is dry (cold cached prefixes are already
        evicted by the pool itself), preempt a running row not yet in this tick."""
        while not self.kv.grow(request, request.num_computed_tokens + num_new):
            protected = {c.request_id for c in out.chunks} | {request.request_id}
            victim = pick_reclaim_victim(self.running, protected)
            if victim is None:
                return False
            self.stats.num_reclaim_passes += 1
            self.preempt(victim)
        return True

    def _admit(self, out: SchedulerOutput, chunk: int, decoding: bool) -> None:
        """Batched prefill: up to max_batch_prefill waiting prompts join one forward, each with at most one
        chunk, together at most the token cap (the head always goes). A prompt longer than a chunk is
        the last one admitted, so at most one prefill is ever parked."""
        cap = self.config.batch_prefill_token_cap(chunk)
        if self.step_token_cap is not None:
            cap = self.step_token_cap if cap is None else min(cap, self.step_token_cap)
        admitted = tokens = 0
        while self.waiting and admitted < self.config.max_batch_prefill:
            request = self.waiting[0]
            hit = self.kv.find_prefix(request)
            if hit.pending:
                break  # its prefix is being read from disk; FIFO: the rest (often the same prompt) wait too
            if len(self.running) >= self.config.max_batch_size and not self._evict_for(request, out):
                break
            remaining = request.num_tokens - hit.num_tokens
            num_new = min(remaining, chunk)
            if request.images:  # never end inside a bidirectional image run; wait for the tower
                num_new = request.whole_run_end(hit.num_tokens, hit.num_tokens + num_new) - hit.num_tokens
                if not self._images_ready(request, hit.num_tokens):
                    break  # it waits at the head; running rows go on decoding
            if request.pool_whole and num_new < remaining:
                if admitted:
                    break  # it runs whole, first in a later tick's admissions
                num_new = remaining  # one forward over the whole sequence, past the chunk budget
            if cap is not None and admitted and tokens + num_new > cap:
                break  # bounds one batched prefill's transient; the rest go next tick
            if not self._fits(request, hit, num_new, decoding, out):
                break  # FIFO within a priority: it waits, nothing behind it jumps ahead
            if not self.kv.admit(request, hit, num_new):
                break
            # NOTE: not pop(0): with aging, a row evicted for this request may have been queued ahead of it.
            del self.waiting[next(i for i, r in enumerate(self.waiting) if r is request)]
            self.running.append(request)
            request.status = RequestStatus.PREFILLING
            out.chunks.append(self._chunk(request, num_new))
            tokens += num_new
            admitted += 1
            if num_new < remaining:
                break  # it stays parked for its next chunks

    def _images_ready(self, request: Request, start: int) -> bool:
        """Every image the request still has to prefill from `start` on has its tower output."""
        return self.image_ready is None or all(self.image_ready(item) for item in request.images if item.end > start)

    def _fits(self, request: Request, hit, num_new: int, decoding: bool, out: SchedulerOutput) -> bool:
        """Room for an admission, keeping the watermark free while rows decode; with preemption on,
        strictly lower-priority rows give way first."""
        reserve = 0.0
        if decoding and self.config.watermark_applies:
            reserve = self.config.kv_admission_watermark
        while not self.kv.can_admit(request, hit, num_new, reserve):
            if not self._evict_for(request, out):
                return False
        return True

    def _evict_for(self, arrival: Request, out: SchedulerOutput) -> bool:
        if not self.config.enable_preemption:
            return False
        victim = pick_arrival_victim(self.running, arrival, self.config.preemption_policy)
        if victim is None:
            return False
        # The victim may already hold a row in this tick's plan; it has not run yet, so drop it.
        out.chunks = [c for c in out.chunks if c.request_id != victim.request_id]
        self.preempt(victim)
        return True

    def preempt(self, request: Request) -> None:
        """Release a running row's KV and requeue it; it re-prefills prompt + generated tokens later."""
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.QUEUED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        bisect.insort(self.waiting, request, key=self._queue_key)

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        tokens = request.all_token_ids[start:start + num_new]
        params = request.sampling_params
        needs_history = params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
        return ScheduledChunk(
            request_id=request.request_id, token_ids=tokens, start_position=start,
            block_table=tuple(self.kv.block_table(request.request_id)),
            window_block_table=tuple(self.kv.window_table(request.request_id)),
            sample=start + num_new == request.num_tokens and not request.pooling, sampling_params=params,
            pool=start + num_new == request.num_tokens and request.pooling,
            token_type_ids=(request.token_type_ids[start:start + num_new] if request.token_type_ids is not None
                            else None),
            images=tuple(item for item in request.images if item.offset < start + num_new and item.end > start),
            rope_positions=request.rope_positions_for(start, num_new),
            prompt_token_ids=tuple(request.prompt_token_ids) if needs_history else None,
            output_token_ids=tuple(request.output_token_ids) if needs_history else None,
        )

    def _add_drafts(self, out: SchedulerOutput) -> None:
        """Speculative decoding: extend small-batch decode rows with drafts, one proposer per row.

        Prompt lookup (free, greedy rows) goes first; rows it has nothing for ask the draft model,
        which the runner runs before the forward. Verification is exact: the drafts run as a
        prefill chunk of the row, whose logits are bitwise those of one-at-a-time decoding
        (row-invariant kernels), so greedy rows accept exactly the tokens greedy decoding would
        produce; sampled rows (draft model only) are verified by rejection sampling in the runner.
        """
        decodes = [c for c in out.chunks if c.sample and len(c.token_ids) == 1]
        budget = self.config.speculative_max_rows - len(decodes)  # rows the forward may still grow by
        lookup_cap = self.config.prompt_lookup_max_batch
        use_lookup = self.config.speculative_ngram > 0 and (not lookup_cap or len(decodes) <= lookup_cap)
        model_tokens = self.config.draft_model_tokens
        if model_tokens and self.draft_length is not None:
            # A tick with prefill rows in it is one the adaptive policy does not measure (engine._observe_policy).
            model_tokens = min(model_tokens, self.draft_length(len(decodes), len(decodes) == len(out.chunks)))
        use_model = model_tokens > 0
        for chunk in decodes:
            request = self.requests[chunk.request_id]
            params = request.sampling_params
            if not _can_speculate(params, sampled_ok=use_model) or request.grammar is not None:
                continue  # NOTE: drafts are not checked against a grammar, so constrained rows never draft
            if request.spec_skip_ticks:  # its recent drafts all missed: stop paying for them a while
                request.spec_skip_ticks -= 1  # counted per tick even when the budget is spent
                continue
            if budget <= 0:
                continue
            # Every draft accepted plus the bonus token must still fit max_tokens and the context.
            room = min(budget, params.max_tokens - len(request.output_token_ids) - 1,
                       self.config.max_model_len - request.num_tokens - 1)
            if use_lookup and params.greedy:
                draft = self.proposer.propose(request.all_token_ids, min(room, self.config.speculative_ngram))
                # A guess never preempts anyone: no free block, no draft.
                if draft and self.kv.grow(request, request.num_computed_tokens + 1 + len(draft)):
                    chunk.token_ids = chunk.token_ids + draft
                    self._refresh_tables(chunk)  # grown for the drafts
                    chunk.num_draft_tokens = len(draft)
                    self.stats.num_draft_tokens += len(draft)
                    budget -= len(draft)
                    continue
            num_tokens = min(room, model_tokens) if use_model else 0
            if num_tokens > 0 and self.kv.grow(request, request.num_computed_tokens + 1 + num_tokens):
                self._refresh_tables(chunk)  # grown for the drafts
                chunk.draft = DraftRequest(num_tokens, tuple(request.all_token_ids), request.num_preemptions)
                budget -= num_tokens

    def _refresh_tables(self, chunk: ScheduledChunk) -> None:
        chunk.block_table = tuple(self.kv.block_table(chunk.request_id))
        chunk.window_block_table = tuple(self.kv.window_table(chunk.request_id))

    def _count_step(self, out: SchedulerOutput) -> None:
        if not out.chunks:
            return
        decodes = sum(1 for c in out.chunks if len(c.token_ids) - c.num_draft_tokens == 1 and c.sample)
        if decodes == len(out.chunks):
            self.stats.num_decode_steps += 1
        elif decodes:
            self.stats.num_mixed_steps += 1
        else:
            self.stats.num_prefill_steps += 1

    # -- results ---------------------------------------------------------------------------
    def update(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[tuple[Request, int]]:
        """Apply a forward's results; returns each request that received tokens this tick, with how many."""
        advanced = []
        if plan.pending_snapshots:
            self.kv.commit_snapshots(plan.pending_snapshots)
        for chunk in plan.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.is_finished:
                self.kv.free_rollback(chunk)
                continue  # aborted while the forward ran
            token = result.sampled_token_ids.get(chunk.request_id)
            new_tokens = [token] if chunk.sample and token is not None else []
            accepted = 0
            drafts = _drafts_of(chunk, result)
            if drafts and new_tokens:
                new_tokens, accepted = _verify(drafts, result.verified_token_ids[chunk.request_id])
                request.spec_rejections = 0 if accepted else min(request.spec_rejections + 1, MAX_SPEC_BACKOFF_EXP)
                request.spec_skip_ticks = _skip_ticks(request.spec_rejections, chunk.draft is not None)
            # Rejected drafts' KV stays behind the cursor, to be overwritten; the blocks stay held.
            computed = len(chunk.token_ids) - chunk.num_draft_tokens + accepted
            if chunk.rollback_slot is not None:
                if accepted < len(drafts):
                    # A recurrent state cannot step back: restore the one after the last accepted draft where a
                    # snapshot holds it, else the nearest before it, and recompute the accepted drafts after
                    # that next tick (their K/V is rewritten with the same bits).
                    slots = (chunk.rollback_slot, *chunk.draft_state_slots)  # after 1, 2, ... rows
                    kept = min(accepted, len(slots) - 1)
                    computed -= accepted - kept
                    self.kv.pending_state_copies.append((slots[kept], chunk.state_slot))
                self.kv.free_rollback(chunk)
            request.num_computed_tokens += computed
            if request.status == RequestStatus.PREFILLING:
                self.stats.num_prompt_tokens_computed += len(chunk.token_ids) - chunk.num_draft_tokens
            if chunk.pool:  # its vector is ready: it ends here, its blocks back at once
                request.pooled = result.pooled.get(chunk.request_id)
                self.kv.cache_computed_blocks(request)
                self.finish(request.request_id, RequestStatus.FINISHED_STOP if request.pooled is not None
                            else RequestStatus.FINISHED_ERROR, None if request.pooled is not None
                            else "the forward returned no pooled output")
                advanced.append((request, 0))
                continue
            count, status = self._append_tokens(request, new_tokens)
            self.stats.num_accepted_tokens += min(accepted, count)  # drafts past a stop never happened
            if chunk.draft is not None and drafts and new_tokens:
                # Drafts past a stop never happened, scored or accepted (as for prompt lookup's accepted count).
                scored = len(drafts) if status is None else min(len(drafts), count)
                self.stats.num_draft_tokens += scored
                self.stats.num_model_draft_tokens += scored
                self.stats.num_model_accepted_tokens += min(accepted, count)
            self.kv.cache_computed_blocks(request)  # after the append: accepted drafts fill blocks too
            if not count:
                continue
            self.stats.num_generated_tokens += count
            advanced.append((request, count))
            if status is not None:
                self.finish(request.request_id, status)
        return advanced

    def _append_tokens(self, request: Request, tokens: list[int]) -> tuple[int, RequestStatus | None]:
        """Append in order until one ends the request; tokens past it are dropped, as if decoded one by one.

        The finish reason is decided here, once, for every way a request can end by itself: a stop
        token, a stop string (via stop_checker, which also wins over the length limit of the same
        token: the text was cut there), max_tokens or the context window.
        """
        for count, token in enumerate(tokens, start=1):
            request.status = RequestStatus.DECODING
            request.append_output_token(token)
            status = request.check_stop_token()
            if self.stop_checker is not None and self.stop_checker(request, token):
                status = RequestStatus.FINISHED_STOP
            if status is None and request.num_tokens >= self.config.max_model_len:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                return count, status
        return len(tokens), None

    def take_all(self) -> list[Request]:
        """Every unfinished request out, its KV freed, each to re-prefill prompt + generated tokens on another
        core of the same model, as a preemption does (a multi-model server suspending this model)."""
        taken = self.running + self.waiting
        for request in taken:
            self.kv.free(request)
            request.status = RequestStatus.QUEUED
            request.num_computed_tokens = 0
            request.num_preemptions += 1
            del self.requests[request.request_id]
        self.stats.num_preemptions += len(taken)
        self.running.clear()
        self.waiting.clear()
        return taken

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
        request.error = error or request.error  # (a grammar failure recorded its own)
        self._finished_ids.append(request_id)
        self.stats.num_completed += 1
        reason = request.finish_reason or "unknown"
        stats = self.stats
        stats.finished_by_reason[reason] = stats.finished_by_reason.get(reason, 0) + 1
        stats.prompt_tokens_by_reason[reason] = stats.prompt_tokens_by_reason.get(reason, 0) + request.num_prompt_tokens
        stats.generation_tokens_by_reason[reason] = (stats.generation_tokens_by_reason.get(reason, 0)
                                                     + len(request.output_token_ids))
        return request

    def finish_all(self, request_ids: Iterable[str], status: RequestStatus, error: str | None = None) -> list[Request]:
        return [r for rid in list(request_ids) if (r := self.finish(rid, status, error)) is not None]


def _can_speculate(params: SamplingParams, sampled_ok: bool = False) -> bool:
    """Rows whose choice depends on nothing but the logits (no penalties, no logprobs to report):
    greedy ones, and with a draft model unseeded sampled ones (rejection sampling keeps their
    distribution; a seeded row stays off so its draws never depend on whether its batch-mates left room)."""
    if params.logprobs is not None or params.repetition_penalty != 1.0 or params.presence_penalty \
            or params.frequency_penalty:
        return False
    return params.greedy or (sampled_ok and params.seed is None)


def _drafts_of(chunk: ScheduledChunk, result: ModelRunnerOutput) -> list[int]:
    """The unverified tokens a chunk carried: prompt-lookup drafts in the chunk, or the draft model's."""
    if chunk.num_draft_tokens:
        return chunk.token_ids[len(chunk.token_ids) - chunk.num_draft_tokens:]
    if chunk.draft is not None:
        return result.proposed_token_ids.get(chunk.request_id, [])
    return []


def _skip_ticks(misses: int, model_draft: bool) -> int:
    """Ticks a row skips drafting after `misses` straight fully-rejected rounds: 2^n - 1, n counted from the first
    miss for n-gram lookups and from MODEL_DRAFT_MISSES_BEFORE_BACKOFF for model drafters."""
    n = misses - (MODEL_DRAFT_MISSES_BEFORE_BACKOFF - 1 if model_draft else 0)
    return 2 ** n - 1 if n > 0 else 0


def _verify(drafts: list[int], verified: list[int]) -> tuple[list[int], int]:
    """Tokens a draft chunk yields: the accepted drafts plus the model's own next token."""
    accepted = 0
    while accepted < len(drafts) and accepted + 1 < len(verified) and drafts[accepted] == verified[accepted]:
        accepted += 1
    return verified[:accepted + 1], accepted


def _is_decode_row(request: Request) -> bool:
    """The row samples on its next forward: one token left to compute, or a hybrid's few accepted drafts
    recomputed after a state rollback (DECODING with more than one left), which ride with the decode rows."""
    return request.num_tokens - request.num_computed_tokens == 1 or request.status == RequestStatus.DECODING
