"""A thinking budget (Anthropic's `thinking.budget_tokens`) on the engine as it is: the reply in two phases.

    phase 1: the prompt, thinking, stopped at "</think>" or after `budget` tokens
    phase 2: the prompt + phase 1's tokens (+ "\\n</think>\\n\\n" when the budget ended it), the answer

Phase 2 continues from phase 1's exact token ids, so its prefix is a prefix-cache hit and, when the model
closed its thinking within the budget, its tokens are the ones one uninterrupted request would give (greedy
output is batch- and chunk-invariant). The budget applies when the reply starts inside <think> (the
rendered prompt opened it) and no grammar constrains the reply; otherwise the plain group runs.
"""

from __future__ import annotations

import dataclasses

from fastapi import Request as HTTPRequest

from conveyor.engine.outputs import RequestOutput
from conveyor.server.errors import APIError
from conveyor.server.front import ServingFront
from conveyor.server.reply import DeltaGroup
from conveyor.server.request_plan import RequestPlan

CLOSE = "</think>"
FORCED_CLOSE = "\n</think>\n\n"  # what a budget-ended thinking is closed with (Qwen3's own spacing)


async def start_with_budget(serving: ServingFront, http: HTTPRequest, plan: RequestPlan, arrival: float,
                            budget: int | None) -> DeltaGroup:
    parsing = plan.header.parsing
    if budget is None or plan.grammar is not None or parsing is None or parsing.thinking is not True:
        return await serving.start(http, plan, arrival)
    first_max = budget if plan.max_tokens is None else min(budget, plan.max_tokens)
    stops = [plan.body.stop] if isinstance(plan.body.stop, str) else list(plan.body.stop or [])
    thinking = dataclasses.replace(plan, body=plan.body.model_copy(update={"stop": [*stops, CLOSE]}),
                                   max_tokens=first_max)
    return BudgetedGroup(serving, http, plan, arrival, budget, await serving.start(http, thinking, arrival))


class BudgetedGroup:
    """One choice's deltas across the two phases, as one stream: counts are the whole reply's."""

    def __init__(self, serving: ServingFront, http: HTTPRequest, plan: RequestPlan, arrival: float, budget: int,
                 thinking: DeltaGroup) -> None:
        self.serving, self.http, self.plan, self.arrival, self.budget = serving, http, plan, arrival, budget
        self.request_ids = thinking.request_ids
        self._group = thinking
        self._answering = False
        self._output_ids: list[int] = []  # phase 1's tokens, then the forced close
        self._first: RequestOutput | None = None  # phase 1's last delta: the prompt's counts

    @property
    def done(self) -> bool:
        return self._group.done

    def close(self) -> None:
        self._group.close()

    async def next(self) -> tuple[int, RequestOutput]:
        index, out = await self._group.next()
        if self._answering:
            return index, self._counted(out)
        self._output_ids += out.new_token_ids
        if not out.finished or not self._continues(out):
            return index, out
        self._first = out
        return index, await self._answer(out)

    def _continues(self, out: RequestOutput) -> bool:
        """Phase 1 ended by closing its thinking, or by the budget (not by max_tokens, EOS or a stop)."""
        if len(self._output_ids) != out.num_output_tokens:  # every token must be known to continue from them
            return False
        if out.finish_reason == "stop":
            return out.stop_sequence == CLOSE
        budget_ended = self.plan.max_tokens is None or out.num_output_tokens < self.plan.max_tokens
        return out.finish_reason == "length" and out.num_output_tokens >= self.budget and budget_ended

    async def _answer(self, first: RequestOutput) -> RequestOutput:
        """Start phase 2; the delta that bridges the phases carries the close the parser needs to see."""
        closed_itself = first.finish_reason == "stop"
        if not closed_itself:
            self._output_ids += self.serving.tokenizer.encode(FORCED_CLOSE, add_special_tokens=False)
        used = len(self._output_ids)
        if self.plan.max_tokens is not None and used >= self.plan.max_tokens:
            return dataclasses.replace(first, finish_reason="length", stop_sequence=None)
        answer = dataclasses.replace(self.plan, prompts=[self.plan.prompts[0] + self._output_ids],
                                     max_tokens=None if self.plan.max_tokens is None else self.plan.max_tokens - used)
        try:
            self._group = await self.serving.start(self.http, answer, self.arrival)
        except APIError as exc:  # e.g. the queue filled up between the phases
            return dataclasses.replace(first, finish_reason="error", error=exc.message, stop_sequence=None)
        self._answering = True
        bridge = CLOSE if closed_itself else FORCED_CLOSE
        return dataclasses.replace(first, new_text=first.new_text + bridge, finished=False, finish_reason=None,
                                   stop_sequence=None, num_output_tokens=used)

    def _counted(self, out: RequestOutput) -> RequestOutput:
        first = self._first
        assert first is not None
        return dataclasses.replace(out, num_prompt_tokens=first.num_prompt_tokens,
                                   num_cached_tokens=first.num_cached_tokens,
                                   num_output_tokens=len(self._output_ids) + out.num_output_tokens)
