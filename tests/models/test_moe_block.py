"""The sparse MoE block: each row's output is bitwise the same alone, in any batch and in any order."""

from __future__ import annotations

import pytest
import torch

from conveyor.config import kernel_settings_from_env
from conveyor.kernels import cpu_backend
from conveyor.models.moe import SparseMoeBlock, route
from conveyor.models.registry import build_model
from conveyor.testing import tiny_hybrid_checkpoint, tiny_moe_checkpoint

ops = cpu_backend(kernel_settings_from_env())
pytestmark = pytest.mark.batch_invariant


def _block(architecture: str, weight_dtype: str) -> SparseMoeBlock:
    checkpoint = tiny_moe_checkpoint(architecture, num_experts=8, num_experts_per_tok=3)
    model = build_model(checkpoint.config, checkpoint.weights, torch.bfloat16, torch.device("cpu"), True,
                        weight_dtype, ops=ops)
    return model.layers[0].mlp


@pytest.mark.parametrize(("architecture", "weight_dtype"), [("mixtral", "auto"), ("qwen3_moe", "q8_0")])
def test_rows_do_not_depend_on_batch_mates(architecture, weight_dtype):
    block = _block(architecture, weight_dtype)
    if weight_dtype == "q8_0" and ops.runs_quantized(8):
        assert block.experts[0].gate_up_proj.segments  # experts on the quantized kernel, one packed linear each
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    _, expert_ids = route(block.gate(x), block.top_k, block.renormalise)
    assert len(expert_ids.unique()) == 8 and expert_ids[:, 0].bincount().max() > 1  # experts shared by rows
    batched = block(x)
    alone = torch.cat([block(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(batched, alone)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    assert torch.equal(block(x[perm]), batched[perm])
    assert torch.equal(block(x[:5]), batched[:5])


@pytest.mark.parametrize(("architecture", "weight_dtype"),
                         [("qwen3_moe", "q8_0"), ("gpt_oss", "q4_0"), ("nemotron_h", "q8_0"), ("mixtral", "auto")])
def test_grouped_experts_give_the_loops_bits(architecture, weight_dtype):
    """Quantized experts run as one grouped GEMM per projection (SwiGLU; GPT-OSS's clamped, biased one; relu^2),
    bitwise as the per-expert loop; bf16 experts keep the loop."""
    if architecture == "nemotron_h":
        checkpoint = tiny_hybrid_checkpoint(architecture)
    else:
        checkpoint = tiny_moe_checkpoint(architecture, num_experts=8, num_experts_per_tok=3)
    model = build_model(checkpoint.config, checkpoint.weights, torch.bfloat16, torch.device("cpu"), True,
                        weight_dtype, ops=ops)
    block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
    if weight_dtype == "auto" or not ops.runs_quantized(8):
        assert block.grouped is None
        return
    assert block.grouped is not None
    if architecture == "gpt_oss":  # the biases ride along
        assert block.grouped.first.bias_f32 and block.grouped.down.bias_f32
    gen = torch.Generator().manual_seed(3)
    for rows in (1, 2, 5, 16, 37):
        x = torch.randn(rows, checkpoint.config.hidden_size, generator=gen).to(torch.bfloat16)
        grouped = block(x)
        block.grouped, saved = None, block.grouped  # force the per-expert loop
        try:
            loop = block(x)
        finally:
            block.grouped = saved
        assert torch.equal(grouped, loop), rows


def test_route_renormalises_top_k():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 0.0, 1.0]])
    weights, ids = route(logits, 2, renormalise=False)
    assert ids.tolist() == [[3, 2], [0, 3]]
    torch.testing.assert_close(weights, torch.softmax(logits, -1).topk(2).values)
    weights, _ = route(logits, 2, renormalise=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))


@pytest.mark.parametrize("num_experts", [8, 60, 128, 256])
def test_routing_of_a_row_does_not_depend_on_the_rows_beside_it(num_experts):
    logits = torch.randn(97, num_experts, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for renormalise in (True, False):
        weights, ids = route(logits, 8, renormalise)
        for start, rows in ((0, 1), (5, 1), (3, 7), (10, 33), (0, 64)):
            got_w, got_ids = route(logits[start:start + rows], 8, renormalise)
            assert torch.equal(got_w, weights[start:start + rows]) and torch.equal(got_ids, ids[start:start + rows])
