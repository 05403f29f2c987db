"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE, OLMoE): top-k routing, experts run batched.

    rows x (T, H) --router--> per row: k expert ids and k weights, by rank (r = 0 is the best expert)
    assignment a = t*k + r, sorted by expert id:  | e0: a.. | e1: a.. | ... |  -> one GEMM per expert hit
    outputs put back at t*k + r; per row y = w_0*o_0 + w_1*o_1 + ... in rank order (fp32), once rounded

Batch invariance: every GEMM is row-invariant at any M (RowInvariantLinear), routing is computed per
row, and a row's k expert outputs are added in that row's own rank order, so which other rows chose
the same expert (and how many did) never changes a row's bits.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from conveyor.kernels import KernelBackend
from conveyor.loading.checkpoint import Weight
from conveyor.models.config import ExpertNames, ModelConfig
from conveyor.models.layers import RowInvariantLinear
from conveyor.models.weights import WeightLoader


class ExpertMLP(nn.Module):
    """One expert: SwiGLU with gate and up fused into one GEMM."""

    def __init__(self, hidden_size: int, width: int, ops: KernelBackend) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = RowInvariantLinear(hidden_size, 2 * width, bias=False, ops=ops)
        self.down_proj = RowInvariantLinear(width, hidden_size, bias=False, ops=ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (M, H) -> (M, H)
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits -> fp32 weights and expert ids (T, k), best first.

    Softmax over all experts, then the top k (Mixtral, Qwen3-MoE, OLMoE); `renormalise` makes the k sum to 1.
    Every op is per row, so a row's routing does not depend on the rows beside it.
    """
    probs = torch.softmax(logits.float(), dim=-1)  # (T, E)
    weights, expert_ids = probs.topk(top_k, dim=-1)  # (T, k)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalise = config.norm_topk_prob
        self.gate = RowInvariantLinear(config.hidden_size, config.num_experts, bias=False, ops=ops)  # the router
        self.experts = nn.ModuleList(ExpertMLP(config.hidden_size, config.moe_intermediate_size, ops)
                                     for _ in range(config.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        num_tokens, k = x.shape[0], self.top_k
        weights, expert_ids = route(self.gate(x), k, self.renormalise)  # (T, k) each
        flat = expert_ids.flatten()  # (T*k,): assignment t*k + r
        order = flat.argsort(stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # one host sync per layer
        inputs = x[order // k]  # (T*k, H): each assignment's row, grouped
        outputs = torch.empty_like(inputs)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                outputs[start:start + count] = expert(inputs[start:start + count])
                start += count
        by_rank = torch.empty_like(outputs)
        by_rank[order] = outputs
        by_rank = by_rank.view(num_tokens, k, x.shape[1])  # (T, k, H)
        weighted = by_rank.float() * weights.unsqueeze(-1)  # (T, k, H)
        # NOTE: the fixed per-row order of this sum (rank 0, 1, ...) is what keeps rows batch-invariant.
        y = weighted[:, 0]
        for r in range(1, k):
            y = y + weighted[:, r]
        return y.to(x.dtype)

    def load(self, get: Callable[[str], Weight], prefix: str, names: ExpertNames, loader: WeightLoader) -> None:
        """Router and experts from HF names under the layer's `prefix` (`model.layers.N.`)."""
        # The router stays in the model dtype, never quantized (not even under --weight-dtype int8): routing
        # decisions are sensitive, and llama.cpp keeps ffn_gate_inp in F32 for the same reason.
        self.gate.load_dense(loader.dense(get(names.router(prefix))))
        self.gate.prepack()
        for e, expert in enumerate(self.experts):
            loader.linear(expert.gate_up_proj, [get(names.expert(prefix, e, "gate")), get(names.expert(prefix, e, "up"))])
            loader.linear(expert.down_proj, [get(names.expert(prefix, e, "down"))])
