"""Paged attention's metadata and torch paths: K/V writes into the block pool, and the reference
attention through block tables that runs where the C++ kernel (csrc/attention.cpp, fixed
per-row reduction order) is missing or off CPU. KernelBackend.paged_attention picks between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from conveyor.kernels.kv_quant import as_values, is_quantized, quantize_q8_0
from conveyor.kernels.recurrent import StateMetadata


@dataclass
class AttentionMetadata:
    """Per-forward index tensors shared by every layer (built once per step by the runner)."""

    slot_mapping: torch.Tensor  # (T,) int64: flat cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # (S, max_blocks) int32
    token_seq: torch.Tensor  # (T,) int32: sequence index of each token row
    token_pos: torch.Tensor  # (T,) int32: absolute position of each token row
    # Host copies for the reference path (no device syncs there).
    seq_lens: list[int]  # (S,) tokens visible to the last row of each sequence
    seq_token_counts: list[int]  # (S,) rows of each sequence in this forward, in order
    # Hybrid models: each sequence's state slot for the recurrent layers (None: no recurrent layers).
    state: StateMetadata | None = None
    # Models whose sliding layers keep K/V in their own block group: those layers' slot_mapping and
    # block_tables (every other field is the same); None when all layers share one table.
    window_view: AttentionMetadata | None = None
    # (T,) int32 exclusive end of each row's visible keys, where some row sees past its own position (Gemma 3's image
    # rows attend their whole image run both ways); None: plain causal, token_pos + 1. Windows start from token_pos.
    key_end: torch.Tensor | None = None

    def for_window(self, window: int) -> AttentionMetadata:
        """The metadata a layer with this window (0: full attention) reads and writes its K/V through."""
        return self.window_view if window and self.window_view is not None else self


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V rows (T, KVH, D) into their cache slots (quantized into a Q8_0 cache)."""
    for cache, rows in ((key_cache, key), (value_cache, value)):
        write_rows(cache, rows, slot_mapping)


def write_rows(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter rows (T, KVH, D) into one cache tensor's slots (MLA keeps one tensor per layer: models/mla.py)."""
    num_kv_heads, width = cache.shape[2], cache.shape[3]
    cache.view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, quantize_q8_0(rows) if is_quantized(cache)
                                                   else rows)


def reference_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float, window: int = 0,
                              fused: bool | None = None, softcap: float = 0.0,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Gather each sequence's keys and run masked softmax attention, one sequence at a time.

    `fused` (default: off CPU) runs torch's scaled_dot_product_attention on the gathered copy
    in the activation dtype (flash / memory-efficient kernels on GPUs; never with `softcap` or `sinks`); else
    fp32 matmuls. `sinks` (H,): GPT-OSS's per-head logit, a softmax column without a value."""
    if fused is None:
        fused = query.device.type != "cpu" and not softcap and sinks is None
    if fused and sinks is not None:
        raise ValueError("reference_paged_attention: sinks need the unfused path")
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    work = query.dtype if fused else torch.float32
    outputs = []
    row = 0
    for seq_idx, (seq_len, num_rows) in enumerate(zip(meta.seq_lens, meta.seq_token_counts)):
        num_blocks = (seq_len + block_size - 1) // block_size
        table = meta.block_tables[seq_idx, :num_blocks].long()
        # (L, KVH, D); Q8_0 rows dequantized to fp32
        keys = as_values(key_cache[table].reshape(-1, num_kv_heads, key_cache.shape[3])[:seq_len], query.dtype)
        values = as_values(value_cache[table].reshape(-1, num_kv_heads, value_cache.shape[3])[:seq_len], query.dtype)
        q = query[row:row + num_rows].to(work).transpose(0, 1)  # (H, R, D)
        k = keys.to(work).repeat_interleave(group, dim=1).transpose(0, 1)  # (H, L, D)
        v = values.to(work).repeat_interleave(group, dim=1).transpose(0, 1)
        positions = meta.token_pos[row:row + num_rows].long()
        keys = torch.arange(seq_len, device=query.device)[None, :]
        ends = positions if meta.key_end is None else meta.key_end[row:row + num_rows].long() - 1
        mask = keys > ends[:, None]  # (R, L)
        if window > 0:
            mask |= keys <= positions[:, None] - window
        elif window < 0:  # chunks of -window positions: a query sees its own chunk only
            mask |= keys < (positions[:, None] // -window) * -window
        if fused:
            out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~mask[None], scale=scale)
        else:
            scores = torch.matmul(q, k.transpose(1, 2)) * scale  # (H, R, L)
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(mask[None], float("-inf"))
            if sinks is not None:  # the sink joins the softmax as one more column, then is dropped
                sink = sinks.to(work)[:, None, None].expand(-1, scores.shape[1], 1)  # (H, R, 1)
                probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
            else:
                probs = torch.softmax(scores, dim=-1)
            out = torch.matmul(probs, v)  # (H, R, D)
        outputs.append(out.transpose(0, 1).to(query.dtype))
        row += num_rows
    return torch.cat(outputs, dim=0)


def reference_dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, scale: float,
                              rows: int = 1024) -> torch.Tensor:
    """Full (unmasked) attention over one sequence, e.g. a vision tower's patches: q, k, v (P, H * D) -> (P, H * D).

    In blocks of `rows` queries: 4096 patches x 16 heads of scores at once would be 1 GiB in bf16 (1024 rows: 128
    MiB). The C++ kernel (csrc/dense_attention.h) never holds more than 16 queries' scores per thread."""
    split = lambda t: t.view(t.shape[0], num_heads, -1).transpose(0, 1)  # noqa: E731 (P, H * D) -> (H, P, D)
    qh, vh = split(q), split(v)
    keys = split(k).transpose(1, 2) * scale  # (H, D, P)
    out = torch.empty_like(qh)
    for start in range(0, qh.shape[1], rows):
        scores = torch.matmul(qh[:, start:start + rows], keys)  # (H, rows, P)
        out[:, start:start + rows] = torch.matmul(torch.softmax(scores, dim=-1), vh)
    return out.transpose(0, 1).reshape(q.shape)
