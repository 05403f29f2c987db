"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE, OLMoE, Granite 4.0-H, Nemotron-H): top-k routing,
experts run batched.

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


class SquaredReluMLP(nn.Module):
    """Nemotron-H's MLP and experts: down(relu(up(x))^2), no gate."""

    def __init__(self, hidden_size: int, width: int, ops: KernelBackend) -> None:
        super().__init__()
        self.up_proj = RowInvariantLinear(hidden_size, width, bias=False, ops=ops)
        self.down_proj = RowInvariantLinear(width, hidden_size, bias=False, ops=ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (M, H) -> (M, H)
        h = torch.relu(self.up_proj(x))
        return self.down_proj(h * h)  # an exactly rounded product: the same bits in any batch


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


def route_sigmoid(scores: torch.Tensor, bias: torch.Tensor, top_k: int, num_groups: int, topk_groups: int,
                  renormalise: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) fp32 sigmoid scores -> fp32 weights and expert ids (T, k), as transformers' Nemotron-H router
    (DeepSeek-V3's): scores + bias choose the experts, within the `topk_groups` groups whose two best
    biased scores sum highest; the weights are the unbiased scores, renormalised, times `scale`."""
    choice = scores + bias
    num_tokens, num_experts = scores.shape
    if num_groups > 1:
        grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)
        best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_groups, dim=-1).indices  # (T, topk_groups)
        keep = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=scores.device)
        keep.scatter_(1, best_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(num_experts // num_groups, dim=1), float("-inf"))
    expert_ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, expert_ids)
    if renormalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, expert_ids


class SparseMoeBlock(nn.Module):
    """Softmax top-k routing over SwiGLU experts, unless a subclass routes (`route`) or builds (`expert`) otherwise."""

    def __init__(self, config: ModelConfig, ops: KernelBackend,
                 expert: Callable[[], nn.Module] | None = None) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalise = config.norm_topk_prob
        self.gate = RowInvariantLinear(config.hidden_size, config.num_experts, bias=False, ops=ops)  # the router
        expert = expert or (lambda: ExpertMLP(config.hidden_size, config.moe_intermediate_size, ops))
        self.experts = nn.ModuleList(expert() for _ in range(config.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) -> fp32 weights and expert ids (T, k), best first."""
        return route(self.gate(x), self.top_k, self.renormalise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        num_tokens, k = x.shape[0], self.top_k
        weights, expert_ids = self.route(x)  # (T, k) each
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
        self.load_router(get(names.router(prefix)), loader)
        for e, expert in enumerate(self.experts):
            loader.linear(expert.gate_up_proj, [get(names.expert(prefix, e, "gate")), get(names.expert(prefix, e, "up"))])
            loader.linear(expert.down_proj, [get(names.expert(prefix, e, "down"))])

    def load_router(self, weight: Weight, loader: WeightLoader) -> None:
        # The router stays in the model dtype, never quantized (not even under --weight-dtype int8): routing
        # decisions are sensitive, and llama.cpp keeps ffn_gate_inp in F32 for the same reason.
        self.gate.load_dense(loader.dense(weight))
        self.gate.prepack()


class SigmoidMoeBlock(SparseMoeBlock):
    """Nemotron-H's experts: relu^2 experts routed by `route_sigmoid`, plus one shared expert every row runs."""

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__(config, ops, lambda: SquaredReluMLP(config.hidden_size, config.moe_intermediate_size, ops))
        self.ops = ops
        self.shared_expert = SquaredReluMLP(config.hidden_size, config.shared_expert_intermediate_size, ops)
        self.correction_bias: torch.Tensor | None = None  # (E,) fp32
        self.groups = (config.moe_num_groups, config.moe_topk_groups)
        self.scale = config.routed_scaling_factor

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x).float()  # (T, E)
        # sigmoid as one scalar call per element (kernels' sigmoid_mul), so a row's scores never depend on the batch
        scores = self.ops.sigmoid_mul(torch.ones_like(logits), logits)
        return route_sigmoid(scores, self.correction_bias, self.top_k, *self.groups, self.renormalise, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        return super().forward(x) + self.shared_expert(x)
