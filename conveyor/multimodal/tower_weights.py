"""A vision tower's weights from a checkpoint's tensor names: which prefix an export keeps the tower under, and a
strict load by name. Errors are ValueErrors that name the tensor: the CLI reports them as a one-line load failure."""

from __future__ import annotations

from typing import Any

import torch


def load_renamed(module: torch.nn.Module, weights: dict[str, Any], names: dict[str, str], dtype: torch.dtype,
                 family: str) -> None:
    """Load `module` strictly from `weights` by `names` (ours -> the checkpoint's); a missing tensor names itself
    (a ValueError: the CLI reports a malformed checkpoint in one line, where a KeyError would be a traceback)."""
    state = {}
    for ours, theirs in names.items():
        if theirs not in weights:
            raise ValueError(f"{family} vision: missing tensor {theirs}")
        state[ours] = torch.as_tensor(weights[theirs]).to(dtype)
    module.load_state_dict(state, strict=True, assign=True)
    module.eval()


def find_prefix(weights: dict[str, Any], prefixes: tuple[str, ...], probe: str, family: str) -> str:
    """The first of `prefixes` under which the checkpoint has `probe` (the tensor names vary by export)."""
    for prefix in prefixes:
        if prefix + probe in weights:
            return prefix
    raise ValueError(f"{family} vision: no {probe} under {', '.join(prefixes)}")
