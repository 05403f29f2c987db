"""tower_weights' strict load by name: a tuple of names loads their tensors concatenated along rows (a fused qkv),
each part strictly; renamed_state hands the state over for a module that reshapes a tensor first."""

from __future__ import annotations

import pytest
import torch

from conveyor.multimodal.tower_weights import load_renamed, renamed_state

WEIGHTS = {"q.weight": torch.arange(4.0).reshape(2, 2), "k.weight": torch.ones(2, 2),
           "v.weight": torch.full((2, 2), 7.0, dtype=torch.bfloat16), "q.bias": torch.arange(6.0)}


def test_fused_names_load_their_rows_in_order():
    module = torch.nn.Linear(2, 6)
    load_renamed(module, WEIGHTS, {"weight": ("q.weight", "k.weight", "v.weight"), "bias": "q.bias"}, torch.float32,
                 "test")
    assert torch.equal(module.weight, torch.cat([WEIGHTS["q.weight"], WEIGHTS["k.weight"], torch.full((2, 2), 7.0)]))
    assert module.weight.dtype == torch.float32 and torch.equal(module.bias, WEIGHTS["q.bias"])


def test_a_missing_part_of_a_fused_tensor_is_named():
    with pytest.raises(ValueError, match="^test vision: missing tensor k.bias$"):
        renamed_state(WEIGHTS, {"bias": ("q.bias", "k.bias")}, torch.float32, "test")
    state = renamed_state(WEIGHTS, {"w": "v.weight"}, torch.float16, "test")
    assert state["w"].dtype == torch.float16
