"""Interleaved multimodal rotary tables (Qwen3.5 / Qwen3-VL's apply_interleaved_mrope).

Rotary frequency j reads the h position where j % 3 == 1 and j < 3 * section[1], the w position where j % 3 == 2
and j < 3 * section[2], the t position elsewhere. Each column is gathered from the plain table at that axis'
position, so a row whose three positions are equal (every text row) gets exactly the plain rope's values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from conveyor.models.layers import RotaryEmbedding


def axis_of_columns(section: Sequence[int], rotary_dim: int) -> torch.Tensor:
    """(rotary_dim,) int64: the axis (0 t, 1 h, 2 w) each column of a rotary table rotates by."""
    half = rotary_dim // 2
    if sum(section) != half or len(section) != 3:
        raise ValueError(f"mrope_section {list(section)} must be 3 sections summing to rotary_dim / 2 = {half}")
    axis = torch.zeros(half, dtype=torch.long)
    for a in (1, 2):
        axis[a:3 * section[a]:3] = a
    return torch.cat([axis, axis])


def mrope_tables(rotary: RotaryEmbedding, positions: torch.Tensor, section: Sequence[int],
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (3, T) -> (T, 1, D) cos and signed sin, as RotaryEmbedding.tables for one position per row."""
    axis = axis_of_columns(section, rotary.cos.shape[-1]).to(positions.device)
    pick = axis.expand(1, positions.shape[1], -1)  # (1, T, D)
    cos = rotary.cos[positions].gather(0, pick)[0]  # (3, T, D) -> each column from its axis
    sin = rotary.signed_sin[positions].gather(0, pick)[0]
    return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)
