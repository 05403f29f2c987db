"""The contracts between scheduler, runner and the engine's callers. Plain data, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conveyor.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from conveyor.multimodal.vision import ImageItem


@dataclass
class DraftRequest:
    """Ask the runner's draft model for num_tokens proposals after a decode row's token."""

    num_tokens: int
    history_token_ids: tuple[int, ...]  # prompt + output so far (a snapshot); the chunk's token is the last one
    epoch: int  # the request's preemption count: a re-admitted request's blocks hold no draft KV yet


@dataclass
class ScheduledChunk:
    """One sequence's share of a forward: a prefill chunk or a single decode token."""

    request_id: str
    token_ids: list[int]
    start_position: int
    block_table: tuple[int, ...]  # a snapshot: the request's own table may grow after the chunk is built
    sample: bool  # the chunk reaches the sequence's last known token, so a new token is drawn
    sampling_params: SamplingParams
    # Speculative decoding: the last num_draft_tokens of token_ids are unverified guesses; every
    # row from the last known token on is scored (greedy), see Scheduler.update.
    num_draft_tokens: int = 0
    # Draft-model speculation: the runner proposes the drafts itself (ModelRunnerOutput.proposed_token_ids).
    draft: DraftRequest | None = None
    # Token history for penalties, snapshots like block_table; None when unused.
    prompt_token_ids: tuple[int, ...] | None = None
    output_token_ids: tuple[int, ...] | None = None
    # Hybrid models: the request's recurrent-state slot (engine/state_pool.py); None without recurrent layers.
    state_slot: int | None = None
    # (tokens of this chunk processed, slot): copy the state there at that point (prefix snapshots, rollback)
    state_snapshots: list[tuple[int, int]] = field(default_factory=list)
    rollback_slot: int | None = None  # speculation: the state after the real token, restored if a draft misses
    # ... and after drafts 1, 2, ... (as many as the pool spares): a miss after accepted drafts restores the state
    # there instead of recomputing them next tick
    draft_state_slots: tuple[int, ...] = ()
    # Models with a sliding K/V group: the sliding layers' table (a snapshot too); empty without one.
    window_block_table: tuple[int, ...] = ()
    # Pooling requests (embeddings, scores): the chunk ends the prompt and its rows are pooled, not sampled.
    pool: bool = False
    token_type_ids: list[int] | None = None  # an encoder's segment per token of this chunk (None: type 0)
    # The request's images whose span this chunk overlaps (the runner encodes them and places their rows).
    images: tuple[ImageItem, ...] = ()
    # Multimodal rotary (Qwen-VL): the (t, h, w) rotary positions of the chunk's rows (drafts appended later
    # continue the last on every axis); None: its sequence positions.
    rope_positions: tuple[list[int], ...] | None = None


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), done before the forward
    window_block_copies: list[tuple[int, int]] = field(default_factory=list)  # the sliding group's, likewise
    finished_request_ids: list[str] = field(default_factory=list)  # runner drops their sampling state
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) state slots, before the forward
    # Prefix snapshots this forward writes: (prefix hash, slot), committed to the pool once it ran.
    pending_snapshots: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # alternatives, best first


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # Chunks with drafts: the greedy token after each of their 1 + num_draft_tokens scored rows.
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Chunks with a DraftRequest: the draft model's proposals that were verified in this forward.
    proposed_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Pooling chunks: the request's vector (an embedding) or its one-element score, fp32 on the CPU.
    pooled: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """One delta of a request's stream: the tokens and text produced since the last delta."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    stop_sequence: str | None = None  # on the last delta, the stop string that ended the request (if one did)
    # Prefill role only: the sequence left this engine after its first token (engine/kv_transfer.py).
    kv_handoff: object | None = None
    # Pooling requests, on the last delta: the embedding (or a reranker's one score).
    pooled: list[float] | None = None
