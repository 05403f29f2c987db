"""DFlash drafting (models/dflash.py): one drafter forward proposes a row's whole block of drafts.

The drafter attends to K/V of the target's fused features, so `record()` writes them as soon as the target's
forward hands its streams over, every row of every chunk (prefill, decode, verify): nothing waits per request.
A verify chunk's rejected rows leave stale K/V behind, at positions the next block starts at or past: the block
overwrites them, and the target's rows there overwrite them again once verified.

    positions        0 ........... p-1 | p     p+1   ...  p+k
    drafter cache    context K/V       | block K/V (written by the draft, replaced by record() after verify)
    block input      -                 | x_p   MASK  ...  MASK      -> rows 1..k: d_1 .. d_k

Every block row sees keys up to p+k (AttentionMetadata.key_end), the block both ways.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
from conveyor.runner.draft_runner import Proposal, confident_rows, pick_drafts


class DFlashRunner:
    wants_hidden = True  # ModelRunner.forward hands this runner the target's streams (record())

    def __init__(self, runner, p_min: float = 0.0) -> None:  # runner: a ModelRunner over the DFlashHead
        self.runner = runner
        self.head = runner.model
        self.p_min = p_min  # --draft-p-min: a greedy row's block ends at its first draft this unsure
        self.aux_layers = self.head.aux_layer_ids
        self.max_drafts = self.head.spec.block_size - 1

    def forget(self, request_ids: list[str]) -> None:
        self.runner.sampler.forget(request_ids)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(copies)

    def record(self, chunks: list[ScheduledChunk], aux: torch.Tensor) -> None:
        """After the target's forward: aux (T, n * H), every row of `chunks` in order -> the drafter's K/V there."""
        # Only positions and slots: a whole prepare_inputs builds tables this write never reads.
        bs, positions, slots, keep = self.runner.block_size, [], [], []
        for chunk in chunks:
            n = len(chunk.token_ids)
            if not chunk.pool:
                table, start = chunk.block_table, chunk.start_position
                positions += range(start, start + n)
                slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            keep += [not chunk.pool] * n
        if not slots:
            return
        if not all(keep):
            aux = aux[torch.tensor(keep, device=aux.device)]
        device = aux.device
        self.head.write_context(self.head.fuse(aux), torch.tensor(positions, dtype=torch.long, device=device),
                                self.runner.kv_caches, torch.tensor(slots, dtype=torch.long, device=device))

    def propose(self, chunks: list[ScheduledChunk]) -> dict[str, Proposal]:
        """One block per decode chunk with a DraftRequest, all rows in one drafter forward."""
        steps = []
        for chunk in chunks:
            k = min(chunk.draft.num_tokens, self.max_drafts)
            if k > 0:  # the block: the row's token, then a mask per draft (all its rows score: num_draft_tokens)
                block = chunk.token_ids[:1] + [self.head.spec.mask_token_id] * k
                steps.append(ScheduledChunk(chunk.request_id, block, chunk.start_position, chunk.block_table, True,
                                            chunk.sampling_params, num_draft_tokens=k))
        if not steps:
            return {}
        logits, token_ids = self.head.draft_logits(self.block_outputs(steps))  # (sum k, N or V)
        per_row = [s for s in steps for _ in range(s.num_draft_tokens)]
        sampled = {s.request_id for s in steps if not s.sampling_params.greedy}
        probs: dict[str, list[torch.Tensor]] = {rid: [] for rid in sampled}
        tokens = pick_drafts(self.runner.sampler, logits, per_row, sampled, probs, token_ids)
        keep = confident_rows(logits, per_row, sampled, self.p_min)
        proposals, at = {}, 0
        for s in steps:
            block = range(at, at + s.num_draft_tokens)
            proposal = Proposal([tokens[i] for i in itertools.takewhile(lambda i: keep[i], block)])
            at += s.num_draft_tokens
            if s.request_id in sampled:
                proposal.probs = torch.stack(probs[s.request_id])  # (k, V)
            proposals[s.request_id] = proposal
        return proposals

    def block_logits(self, steps: list[ScheduledChunk]) -> torch.Tensor:
        """The blocks' one drafter forward -> logits of every block row but the first, block by block (sum k, V)."""
        return self.head.compute_logits(self.block_outputs(steps))

    def block_outputs(self, steps: list[ScheduledChunk]) -> torch.Tensor:
        """The blocks' one drafter forward -> the normed output of every block row but the first (sum k, H)."""
        inputs = self.runner.prepare_inputs(SchedulerOutput(chunks=steps))
        ends = [s.start_position + len(s.token_ids) for s in steps for _ in s.token_ids]
        meta = replace(inputs.meta, key_end=torch.tensor(ends, dtype=torch.int32, device=inputs.input_ids.device))
        out = self.head(inputs.input_ids, inputs.positions, self.runner.kv_caches, meta)  # (T, H)
        # every row but each block's first (x_p's own row predicts nothing the target does not)
        firsts, at = set(), 0
        for s in steps:
            firsts.add(at)
            at += len(s.token_ids)
        rows = torch.tensor([i for i in range(at) if i not in firsts], device=out.device)
        return out[rows]
