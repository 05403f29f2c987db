"""A request's state as the scheduler sees it (no tensors here)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conveyor.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from conveyor.multimodal.vision import ImageItem
    from conveyor.structured.compiler import GrammarState


class RequestStatus(enum.IntEnum):
    """Ordered: every status from FINISHED_STOP on is terminal."""

    QUEUED = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED_STOP = 3
    FINISHED_LENGTH = 4
    FINISHED_CANCELLED = 5
    FINISHED_ERROR = 6
    FINISHED_HANDED_OFF = 7  # prefill role: the sequence continues on a decode node

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOP


# The one map from terminal states to OpenAI's finish_reason.
FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOP: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_CANCELLED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_HANDED_OFF: "handoff",
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # higher runs first
    cache_prompt: bool = True  # per-request opt out of the prefix cache
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.QUEUED
    output_token_ids: list[int] = field(default_factory=list)
    # The one scheduling variable: tokens whose KV is in the cache. It catches up with
    # num_tokens through prefill chunks, prefix hits, decode steps and re-prefill.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens adopted from the prefix cache at last admission
    num_preemptions: int = 0
    first_token_time: float | None = None
    error: str | None = None
    # Speculative decoding back-off: after k straight fully-rejected drafts, skip 2^k - 1 ticks.
    spec_rejections: int = 0
    spec_skip_ticks: int = 0
    # Constrained decoding: the grammar position, advanced with every output token (which survive
    # preemption, so a re-prefilled row resumes where its grammar stands).
    grammar: GrammarState | None = None
    # Chain keys of its full blocks so far (engine/block_keys.py), extended as needed: tokens only append.
    block_keys: list[int] = field(default_factory=list, repr=False)
    # A pooling request (an embedding or a reranker's score): prefill only, its last chunk pooled, nothing
    # sampled; `whole` ones (bidirectional models, mean / CLS pooling) run their prompt in one forward.
    pooling: bool = False
    pool_whole: bool = False
    pooled: list[float] | None = None  # the result, once its last chunk ran
    # An encoder's segment of each prompt token (a cross-encoder's second text is type 1); None: all type 0.
    token_type_ids: list[int] | None = None
    # Its images, placed in the (expanded) prompt (multimodal/vision.py): their hashes join the block keys of the
    # blocks they overlap, and the runner puts their encoder output at their embed rows.
    images: list[ImageItem] = field(default_factory=list, repr=False)
    # Multimodal rotary (Qwen-VL): the prompt's (t, h, w) rotary positions (three lists), later rows at their
    # position + rope_delta on each axis (ExpandedPrompt's).
    rope_positions: tuple[list[int], list[int], list[int]] | None = field(default=None, repr=False)
    rope_delta: int = 0

    @property
    def key_spans(self) -> list[tuple[int, int, bytes]]:
        """(start, end, content hash) of each image span: what a block overlapping one folds into its key."""
        return [(item.offset, item.end, bytes.fromhex(item.content_hash)) for item in self.images]

    def rope_positions_for(self, start: int, num: int) -> tuple[list[int], ...] | None:
        """The (t, h, w) rotary positions of rows [start, start + num), or None for plain positions."""
        if self.rope_positions is None:
            return None
        later = list(range(max(start, self.num_prompt_tokens) + self.rope_delta, start + num + self.rope_delta))
        return tuple(axis[start:start + num] + later for axis in self.rope_positions)

    def whole_run_end(self, start: int, end: int) -> int:
        """A prefill chunk [start, end) moved so it does not end inside a bidirectional image run: back to the run's
        start, or (a chunk starting in or at the run) on to its end, past the chunk budget."""
        for item in self.images:
            for lo, hi in item.bidirectional_runs():
                if lo < end < hi:
                    return lo if lo > start else hi
        return end

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self.grammar is not None and not self.grammar.accept(token_id):
            self.error = self.grammar.error
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def check_stop_token(self) -> RequestStatus | None:
        """Terminal status implied by the last sampled token (stop strings are checked by the detokenizer)."""
        last = self.output_token_ids[-1]
        params = self.sampling_params
        if self.grammar is not None:
            if self.grammar.error is not None:
                return RequestStatus.FINISHED_ERROR
            if self.grammar.is_done:  # complete: nothing but EOS could follow
                return RequestStatus.FINISHED_STOP
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOP
        if len(self.output_token_ids) >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
