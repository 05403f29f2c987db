"""Speculative rejection sampling: verify sampled drafts so the output is distributed as plain sampling.

The draft proposes d_1..d_k from its distributions q_1..q_k; the target scores them in one forward,
giving p_1..p_{k+1}. Draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); the first
rejected position draws from the residual max(0, p_i - q_i) (renormalised), and when every draft
is accepted the bonus token draws from p_{k+1} (Leviathan et al. 2023, Chen et al. 2023). Each
emitted token is then exactly a draw from the target's distribution given the tokens before it.
"""

from __future__ import annotations

import torch


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_ids: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs (R, k+1, V), draft_probs (R, k, V), draft_ids (R, k) ->
    (tokens (R, k+1), num_accepted (R,)): row r emits tokens[r, :num_accepted[r] + 1]."""
    num_rows, k, _ = draft_probs.shape
    rows = torch.arange(num_rows, device=draft_ids.device)[:, None]
    steps = torch.arange(k, device=draft_ids.device)[None, :]
    p = target_probs[rows, steps, draft_ids]  # (R, k) target probability of each draft
    q = draft_probs[rows, steps, draft_ids]  # (R, k) > 0: the draft was drawn from q
    u = torch.rand(num_rows, k, generator=generator, device=draft_probs.device)
    accepted = u * q < p  # u < p / q without dividing by a tiny q
    # Leading run of accepts: cumprod stays 1 until the first rejection.
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # (R,)

    # The distribution of the token after the accepted run: residual where a draft was rejected,
    # the target's own distribution (the bonus) where all k were accepted.
    at = num_accepted.clamp(max=k - 1)
    residual = (target_probs[rows[:, 0], at] - draft_probs[rows[:, 0], at]).clamp(min=0)  # (R, V)
    # NOTE: a rejection needs p(d) < q(d), so the residual at d is 0 in exact arithmetic; zeroing it
    # guards the float case and keeps "the emitted token differs from the rejected draft" exact.
    residual[rows[:, 0], draft_ids[rows[:, 0], at]] = 0
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # p == q up to rounding: reject odds were ~0
    residual = torch.where(empty, target_probs[rows[:, 0], at], residual)
    final = torch.where((num_accepted == k)[:, None], target_probs[:, k], residual)
    next_token = _draw(final, generator)  # (R,)

    tokens = torch.cat([draft_ids, torch.zeros_like(draft_ids[:, :1])], dim=1)  # (R, k+1)
    tokens[rows[:, 0], num_accepted] = next_token
    return tokens, num_accepted


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row; the sampler's exponential race (argmax p / Exp(1)), unnormalised p is fine."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)
