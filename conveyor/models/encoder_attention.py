"""Attention over whole sequences in this forward (the encoders': every text runs in one forward), in torch.

One sequence at a time, on fresh copies: a row's bits depend on its own sequence only, never on its place in the
batch. Whole-text attention runs torch's fused kernel; a band (ModernBERT's local layers) goes query rows CHUNK at
a time against the keys they reach, in fp32. Faster than the paged kernel here, whose
per-row walk over the keys is made for decode: a BERT-small forward spent two thirds of its time there.
"""

from __future__ import annotations

import torch
from torch import nn

CHUNK = 512  # query rows per matmul: bounds the (H, rows, keys) fp32 scores of a long text (12 heads: 12 MiB)


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: list[int], scale: float,
                       half_window: int = 0) -> torch.Tensor:
    """q (T, H, D), k and v (T, KVH, D): whole sequences of `counts` rows, end to end -> (T, H, D); row i of a
    sequence attends every key of it, or (half_window > 0) its keys j with |i - j| <= half_window. Rows go
    CHUNK at a time against the keys they reach:

        keys   [lo - w ........................ hi + w)
        rows          [lo ........... hi)        (w: half_window; the whole sequence when 0)
    """
    if not half_window:
        return _whole_attention(q, k, v, counts, scale)
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    start = 0
    for count in counts:
        keys_all, values_all = _heads_first(k[start:start + count], group), _heads_first(v[start:start + count], group)
        for lo in range(0, count, CHUNK):
            hi = min(lo + CHUNK, count)
            first, end = (max(0, lo - half_window), min(count, hi + half_window)) if half_window else (0, count)
            rows = _heads_first(q[start + lo:start + hi])  # (H, R, D)
            keys, values = keys_all[:, first:end], values_all[:, first:end]
            scores = torch.matmul(rows, keys.transpose(1, 2)).mul_(scale)  # (H, R, K)
            if half_window:
                offsets = (torch.arange(lo, hi, device=q.device)[:, None]
                           - torch.arange(first, end, device=q.device)[None, :])  # (R, K)
                scores.masked_fill_((offsets.abs() > half_window)[None], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start + lo:start + hi] = torch.matmul(probs, values).transpose(0, 1)  # (R, H, D)
        start += count
    return out


def _whole_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: list[int],
                     scale: float) -> torch.Tensor:
    """Every row of a text attends all of it: torch's fused attention per text, in the model dtype (its CPU kernel
    accumulates in fp32; on bf16 it ran a MiniLM-sized layer 1.8x faster than fp32 matmuls), on fresh contiguous
    (1, H, rows, D) copies, so a text's bits are the same alone or in any batch."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    start = 0
    for count in counts:
        rows, keys, values = (t[start:start + count].transpose(0, 1).contiguous()[None] for t in (q, k, v))
        if group > 1:
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        out[start:start + count] = nn.functional.scaled_dot_product_attention(
            rows, keys, values, scale=scale)[0].transpose(0, 1)
        start += count
    return out


def _heads_first(x: torch.Tensor, group: int = 1) -> torch.Tensor:
    """(R, H, D) -> a fresh contiguous fp32 (H * group, R, D): the matmuls see the same buffer layout wherever the
    rows sat (K/V heads repeated for grouped queries)."""
    x = x.transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    return x.repeat_interleave(group, dim=0) if group > 1 else x
