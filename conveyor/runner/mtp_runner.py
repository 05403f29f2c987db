"""MTP drafting: the model's own multi-token-prediction head (models/mtp.py) proposes the drafts.

The head at position q reads the target's hidden state h_q and the token x_{q+1}, so unlike a draft model it
cannot catch up from tokens alone: the target's forward hands every row's hidden state to `record()`, which
keeps them per request until the token after each is known, and the head consumes them in order:

    positions          start ....... p-1 | p          (p: the decode row's token x_p, not yet in the target)
    pending hiddens    h_start ..... h_{p-1}
    head input tokens  x_{start+1} .. x_p             -> last row: the first draft d_1
    chained rows       (d_1, out_{p-1}) at p, (d_2, out_p) at p+1, ...   -> d_2, d_3, ...

The head's K/V is its own (one layer, the target's block tables: freed with the request's blocks). A verify
chunk's rows come back as pending hiddens; the next chunk's start position cuts them to what was accepted (or
recomputed, on a hybrid's rollback), so accepted positions are rewritten from the target's hidden states and
rejected ones are overwritten later. Rows that do not draft are flushed through the head in batches of
FLUSH_ROWS, so a long prompt never waits in memory and a later draft finds the head's K/V filled in.

While nothing drafts at the tick's batch size (`defer`, set by the engine each tick: the draft policy declines
there, or a cold bucket still probes classic steps; never with prefix caching on, where a request's blocks, head K/V
included, outlive it for later hits), rows wait instead, up to
DEFER_BYTES per request: a request that ends before it drafts never pays for its head rows (~3 % of a C=16 run of a
Qwen3.5-shaped 0.8B whose policy declines there). A later draft runs them in its first head forward (the head's
kernels are row-invariant: the same K/V and drafts as flushed ones), and that tick reports `paid_deferred`, so the
policy does not time it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
from conveyor.runner.draft_runner import Proposal, confident_rows, pick_drafts

FLUSH_ROWS = 32  # pending rows of a row that does not draft, fed to the head in one go
DEFER_BYTES = 4 << 20  # pending hidden states one request may hold while the policy declines (then flushed)


@dataclass
class _Pending:
    """Target hidden states whose head rows are not computed yet, at positions start, start + 1, ..."""

    start: int
    token_ids: list[int]  # the tokens at those positions
    parts: list[torch.Tensor]  # (n_i, H) pieces of the target's final hidden states there, in order
    deferred: bool = False  # kept past FLUSH_ROWS while the policy declined

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def hiddens(self) -> torch.Tensor:
        """(n, H), the pieces joined once (a decode row appends one piece per tick: no copy of the rest)."""
        if len(self.parts) > 1:
            self.parts = [torch.cat(self.parts)]
        return self.parts[0]


class MTPRunner:
    wants_hidden = True  # ModelRunner.forward hands this runner the target's hidden states (record())
    aux_layers: tuple[int, ...] = ()  # the final-normed hidden state (EAGLE3: the streams into these layers)

    def __init__(self, runner, p_min: float = 0.0) -> None:  # runner: a ModelRunner over the MTPHead
        self.runner = runner
        self.head = runner.model
        self.p_min = p_min  # --draft-p-min: a greedy row stops drafting at a draft this unsure (confident_rows)
        self._pending: dict[str, _Pending] = {}
        self.defer = False  # this tick: the policy declines at its batch size (the engine sets it)
        self.paid_deferred = False  # this tick's drafts ran rows kept while it declined (the engine reads, resets)

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._pending.pop(request_id, None)
        self.runner.sampler.forget(request_ids)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(copies)

    def record(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> None:
        """After the target's forward: hidden (T, H), every row of `chunks` in order."""
        at, flush = 0, []
        limit = max(FLUSH_ROWS, DEFER_BYTES // max(1, hidden.shape[-1] * hidden.element_size())) if self.defer \
            else FLUSH_ROWS
        for chunk in chunks:
            rows = hidden[at:at + len(chunk.token_ids)]
            at += len(chunk.token_ids)
            if chunk.pool:
                continue
            pending = self._append(chunk, rows)
            # A verify chunk's rows wait for the next chunk to say which drafts were accepted.
            if not (chunk.num_draft_tokens or chunk.draft) and len(pending.token_ids) > FLUSH_ROWS:
                if len(pending.token_ids) > limit:
                    flush.append(chunk)
                else:
                    pending.deferred = True
        if flush:
            self._flush(flush)

    def propose(self, chunks: list[ScheduledChunk]) -> dict[str, Proposal]:
        """One proposal per decode chunk with a DraftRequest: all rows advance together, one forward per draft."""
        proposals = {c.request_id: Proposal([]) for c in chunks}
        wanted = {c.request_id: c.draft.num_tokens for c in chunks}
        sampled = {c.request_id for c in chunks if not c.sampling_params.greedy}
        probs: dict[str, list[torch.Tensor]] = {rid: [] for rid in sampled}
        steps, inputs = [], []
        for chunk in chunks:
            pending = _cut(self._pending.get(chunk.request_id), chunk.start_position)
            if pending is None:  # no hidden state at p-1: nothing to draft from
                continue
            del self._pending[chunk.request_id]  # consumed: the verify chunk's rows come next
            self.paid_deferred |= pending.deferred
            steps.append(ScheduledChunk(chunk.request_id, pending.token_ids[1:] + chunk.token_ids[:1], pending.start,
                                        chunk.block_table, True, chunk.sampling_params))
            inputs.append(pending.hiddens)
        while steps:
            last = self._forward(steps, torch.cat(inputs))  # (R, H): each step's last row
            logits, token_ids = self.head.draft_logits(last)  # (R, N) over a draft vocabulary, or (R, V)
            tokens = pick_drafts(self.runner.sampler, logits, steps, sampled, probs, token_ids)
            keep = confident_rows(logits, steps, sampled, self.p_min)
            next_steps, inputs = [], []
            for i, (step, token) in enumerate(zip(steps, tokens)):
                if not keep[i]:
                    continue
                proposal = proposals[step.request_id]
                proposal.token_ids.append(token)
                if len(proposal.token_ids) < wanted[step.request_id]:
                    position = step.start_position + len(step.token_ids)
                    next_steps.append(ScheduledChunk(step.request_id, [token], position, step.block_table, True,
                                                     step.sampling_params))
                    inputs.append(last[i:i + 1])  # the head's own output stands in for the target's next hidden
            steps = next_steps
        for request_id in sampled:
            if probs[request_id]:
                proposals[request_id].probs = torch.stack(probs[request_id])  # (k, V)
        return proposals

    def _append(self, chunk: ScheduledChunk, rows: torch.Tensor) -> _Pending:
        """The chunk's rows after the pending ones before its start (a new start cuts off rejected drafts)."""
        pending = _cut(self._pending.get(chunk.request_id), chunk.start_position)
        if pending is not None:
            pending.token_ids.extend(chunk.token_ids)
            pending.parts.append(rows.clone())
        else:
            pending = _Pending(chunk.start_position, list(chunk.token_ids), [rows.clone()])
        self._pending[chunk.request_id] = pending
        return pending

    def _flush(self, chunks: list[ScheduledChunk]) -> None:
        """Every pending row but the last (whose next token is not known yet) through the head, for its K/V."""
        steps, inputs = [], []
        for chunk in chunks:
            pending = self._pending[chunk.request_id]
            self.paid_deferred |= pending.deferred  # the policy declined when these waited; now it may be timing
            steps.append(ScheduledChunk(chunk.request_id, pending.token_ids[1:], pending.start, chunk.block_table,
                                        False, chunk.sampling_params))
            inputs.append(pending.hiddens[:-1])
            self._pending[chunk.request_id] = _Pending(pending.end - 1, pending.token_ids[-1:],
                                                       [pending.hiddens[-1:].clone()])
        self._forward(steps, torch.cat(inputs))

    def _forward(self, steps: list[ScheduledChunk], hidden: torch.Tensor) -> torch.Tensor:
        """The head over the steps' rows (hidden (T, H): h at each row's position), its K/V written -> its output at
        the last row of each step that samples (R, H)."""
        inputs = self.runner.prepare_inputs(SchedulerOutput(chunks=steps))
        out = self.head(inputs.input_ids, hidden, inputs.positions, self.runner.kv_caches, inputs.meta)  # (T, H)
        return out[inputs.logits_indices]


class Eagle3Runner(MTPRunner):
    """EAGLE3 (models/eagle3.py) on MTP's machinery: record() gets the target's streams into the drafter's aux
    layers (T, 3H), fused by its fc at once, so what waits per request is the layer's hidden input (T, H)."""

    def __init__(self, runner, p_min: float = 0.0) -> None:
        super().__init__(runner, p_min)
        self.aux_layers = self.head.aux_layer_ids

    def record(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> None:
        super().record(chunks, self.head.fuse(hidden))


def _cut(pending: _Pending | None, position: int) -> _Pending | None:
    """The pending rows before `position`, where they reach it (rows past it: drafts the target rejected, or a
    hybrid's accepted drafts it recomputes); None when none are left or they stop short of it."""
    if pending is None or not pending.start < position <= pending.end:
        return None
    keep = position - pending.start
    if keep == len(pending.token_ids):
        return pending
    return _Pending(pending.start, pending.token_ids[:keep], [pending.hiddens[:keep]], pending.deferred)
