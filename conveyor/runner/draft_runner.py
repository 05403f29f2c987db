"""The draft model of draft-model speculation: proposes tokens for the rows the scheduler picked.

It is a second ModelRunner (own weights, own KV tensors) addressed through the target's block
tables: same block size, same block ids, so it needs no allocator of its own and every block the
target frees frees the draft's copy too. Its KV is filled lazily: before proposing for a row, the
draft catches up on the tokens it has not seen (a whole prompt on a row's first draft, one or two
tokens afterwards), then runs one batched decode step per draft token over all drafting rows.

Draft KV that is stale (a row re-admitted after preemption, positions past a rejected draft) is
recomputed or overwritten; stale draft KV could only lower acceptance, never change the output,
because the target verifies every token.

A hybrid draft (recurrent layers) keeps its state in its own tensors under the row's state slot, and a
recurrent state cannot step back: its catch-up snapshots the state at the end of the row's history into
the row's rollback slot (the target's scratch slot of this tick, in the draft's tensors), and after the
proposal the state is restored from there, so the next catch-up always starts at the history's end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
from conveyor.runner.sampler import Sampler, SamplingRow


@dataclass
class Proposal:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # (k, V) draft distributions of sampled rows; None for greedy rows


@dataclass
class _DraftState:
    epoch: int
    token_ids: list[int] = field(default_factory=list)  # tokens whose draft KV is in the cache, from position 0


class DraftRunner:
    wants_hidden = False  # the target's hidden states feed an MTP head (runner/mtp_runner.py), not a draft model

    def __init__(self, runner, recurrent: bool = False, p_min: float = 0.0) -> None:  # runner: over the draft model
        self.runner = runner
        self.recurrent = recurrent  # a hybrid draft: its state rolls back through the rows' rollback slots
        self.p_min = p_min  # --draft-p-min: a greedy row stops drafting at a draft this unsure (confident_rows)
        self._states: dict[str, _DraftState] = {}

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)
        self.runner.sampler.forget(request_ids)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(copies)

    def propose(self, chunks: list[ScheduledChunk]) -> dict[str, Proposal]:
        """One proposal per chunk with a DraftRequest; all rows advance together, one forward per draft token."""
        steps = [self._catch_up_chunk(c) for c in chunks]
        wanted = {c.request_id: c.draft.num_tokens for c in chunks}
        proposals = {c.request_id: Proposal([]) for c in chunks}
        sampled = {c.request_id for c in chunks if not c.sampling_params.greedy}
        probs: dict[str, list[torch.Tensor]] = {rid: [] for rid in sampled}
        while steps:
            logits, _ = self.runner.forward(SchedulerOutput(chunks=steps))  # (R, V), one row per step chunk
            tokens = pick_drafts(self.runner.sampler, logits, steps, sampled, probs)
            keep = confident_rows(logits, steps, sampled, self.p_min)
            next_steps = []
            for step, token, kept in zip(steps, tokens, keep):
                if not kept:
                    continue
                proposal = proposals[step.request_id]
                proposal.token_ids.append(token)
                if len(proposal.token_ids) < wanted[step.request_id]:
                    position = step.start_position + len(step.token_ids)
                    next_steps.append(ScheduledChunk(step.request_id, [token], position, step.block_table, True,
                                                     step.sampling_params, state_slot=step.state_slot))
            steps = next_steps
        for chunk in chunks:
            proposal = proposals[chunk.request_id]
            state = self._states[chunk.request_id]
            # The last draft was never fed back, so its KV is not written; a recurrent state goes back to the
            # history's end (restored below), where the next catch-up starts.
            fed = [] if self.recurrent else proposal.token_ids[:-1]
            state.token_ids = list(chunk.draft.history_token_ids) + fed
            if chunk.request_id in sampled:
                proposal.probs = torch.stack(probs[chunk.request_id])  # (k, V)
        if self.recurrent:
            self.runner.copy_states([(c.rollback_slot, c.state_slot) for c in chunks])
        return proposals

    def _catch_up_chunk(self, chunk: ScheduledChunk) -> ScheduledChunk:
        """The tokens the draft has not computed yet, up to and including the row's decode token."""
        draft = chunk.draft
        history = list(draft.history_token_ids)
        state = self._states.get(chunk.request_id)
        if state is None or state.epoch != draft.epoch:
            state = self._states[chunk.request_id] = _DraftState(draft.epoch)
        valid = _common_prefix(state.token_ids, history, limit=len(history) - 1)
        if not self.recurrent:
            return ScheduledChunk(chunk.request_id, history[valid:], valid, chunk.block_table, True,
                                  chunk.sampling_params)
        if valid != len(state.token_ids):  # a state is all it has seen or nothing: start again from position 0
            valid = 0
        tokens = history[valid:]
        return ScheduledChunk(chunk.request_id, tokens, valid, chunk.block_table, True, chunk.sampling_params,
                              state_slot=chunk.state_slot, state_snapshots=[(len(tokens), chunk.rollback_slot)])


def pick_drafts(sampler: Sampler, logits: torch.Tensor, steps: list[ScheduledChunk], sampled: set[str],
                probs: dict[str, list[torch.Tensor]], token_ids: torch.Tensor | None = None) -> list[int]:
    """One draft per step row: the argmax for greedy rows; for sampled rows a draw from the draft distribution q,
    appended to probs[request] for rejection sampling (runner/rejection.py). `token_ids` (N,): the target ids of
    logits' N columns (a draft vocabulary, ascending); None: the columns are the whole vocabulary."""
    tokens = sampler.ops.argmax(logits)
    if token_ids is not None:
        tokens = token_ids[tokens]
    rows = [i for i, s in enumerate(steps) if s.request_id in sampled]
    if rows:
        sampling_rows = [SamplingRow(steps[i].request_id, steps[i].sampling_params) for i in rows]
        picked = logits[rows]
        if token_ids is not None:  # q over the target's ids (0 off the subset), as rejection sampling reads it
            picked = picked.new_full((len(rows), sampler.vocab_size), float("-inf")).index_copy_(1, token_ids, picked)
        q = sampler.probabilities(picked, [r.params for r in sampling_rows])  # (S, V)
        noise = torch.empty_like(q).exponential_(generator=sampler.generator_for(sampling_rows[0]))
        drawn = (q / noise).argmax(dim=-1)
        tokens = tokens.clone()
        tokens[rows] = drawn
        for j, i in enumerate(rows):
            probs[steps[i].request_id].append(q[j])
    return tokens.tolist()


def confident_rows(logits: torch.Tensor, steps: list[ScheduledChunk], sampled: set[str], p_min: float) -> list[bool]:
    """Per step row: whether its draft is kept (--draft-p-min). A greedy row's draft is kept while the drafter's
    top probability reaches p_min: a draft it is unsure of is likely rejected, and its verify row and the drafts
    chained after it cost more than they return. Sampled rows keep theirs (rejection sampling weighs them)."""
    if p_min <= 0:
        return [True] * len(steps)
    top = torch.softmax(logits, dim=-1).amax(dim=-1).tolist()  # (R,)
    return [s.request_id in sampled or p >= p_min for s, p in zip(steps, top)]


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:  # the usual case, compared at C speed: the row only grew since its last draft
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
