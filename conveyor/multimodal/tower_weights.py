"""A vision tower's weights from a checkpoint's tensor names: which prefix an export keeps the tower under, and a
strict load by name. Errors are ValueErrors that name the tensor: the CLI reports them as a one-line load failure."""

from __future__ import annotations

from typing import Any

import torch


# ours -> the checkpoint's name, or several names whose tensors are concatenated along rows (a fused qkv, gate_up)
Names = dict[str, str | tuple[str, ...]]


def load_renamed(module: torch.nn.Module, weights: dict[str, Any], names: Names, dtype: torch.dtype,
                 family: str) -> None:
    """Load `module` strictly from `weights` by `names`; a missing tensor names itself."""
    module.load_state_dict(renamed_state(weights, names, dtype, family), strict=True, assign=True)
    module.eval()


def renamed_state(weights: dict[str, Any], names: Names, dtype: torch.dtype, family: str) -> dict[str, torch.Tensor]:
    """The state dict `names` describe, in `dtype` (load_renamed's, for a module that reshapes a tensor first)."""
    state = {}
    for ours, theirs in names.items():
        if isinstance(theirs, str):
            state[ours] = _tensor(weights, theirs, family).to(dtype)
        else:
            state[ours] = torch.cat([_tensor(weights, name, family).to(dtype) for name in theirs])
    return state


def _tensor(weights: dict[str, Any], name: str, family: str) -> torch.Tensor:
    """`weights[name]`, strictly: a ValueError naming a missing tensor (the CLI reports a malformed checkpoint in one
    line, where a KeyError would be a traceback)."""
    if name not in weights:
        raise ValueError(f"{family} vision: missing tensor {name}")
    return torch.as_tensor(weights[name])


def find_prefix(weights: dict[str, Any], prefixes: tuple[str, ...], probe: str, family: str) -> str:
    """The first of `prefixes` under which the checkpoint has `probe` (the tensor names vary by export)."""
    for prefix in prefixes:
        if prefix + probe in weights:
            return prefix
    raise ValueError(f"{family} vision: no {probe} under {', '.join(prefixes)}")
