"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE, OLMoE, Llama 4, GPT-OSS, and the hybrids Qwen3-Next,
Qwen3.5-MoE, LFM2-MoE, Granite 4.0-H, Nemotron-H): top-k routing, experts run batched, plus an always-on shared
expert where the family has one. One block and one routing path for all of them; the config says how it scores,
biases, groups, renormalises and scales (`route`), and what its experts are (SwiGLU, GPT-OSS's clamped SwiGLU
with biases, or relu^2 without a gate).

    rows x (T, H) --router--> per row: k expert ids and k weights, by rank (r = 0 is the best expert)
    assignment a = t*k + r, sorted by expert id:  | e0: a.. | e1: a.. | ... |  -> all experts' GEMMs in one call
                                                   per projection (quantized experts), else two per expert hit
    outputs put back at t*k + r; per row y = w_0*o_0 + w_1*o_1 + ... in rank order (fp32), once rounded

Batch invariance: every GEMM is row-invariant at any M (RowInvariantLinear), routing is computed per
row, and a row's k expert outputs are added in that row's own rank order, so which other rows chose
the same expert (and how many did) never changes a row's bits. Sigmoids (router scores, the shared
expert's gate) run through the backend's scalar-per-element kernel for the same reason.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import nn

from conveyor.kernels import KernelBackend
from conveyor.models.config import ExpertNames, ModelConfig
from conveyor.models.gpt_oss import clamped_swiglu
from conveyor.models.layers import RowInvariantLinear
from conveyor.models.moe_grouped import GroupedExperts, group_experts
from conveyor.models.tensors import Weight
from conveyor.models.weights import WeightLoader


class ExpertMLP(nn.Module):
    """One expert: SwiGLU with gate and up fused into one GEMM (GeGLU with `gelu`: Gemma 4); or (GPT-OSS:
    `clamped`, with biases) OpenAI's clamped SwiGLU, (alpha, limit)."""

    def __init__(self, hidden_size: int, width: int, ops: KernelBackend, bias: bool = False,
                 clamped: tuple[float, float] | None = None, gelu: bool = False) -> None:
        super().__init__()
        self.ops = ops
        self.clamped = clamped
        self.gate_up_proj = RowInvariantLinear(hidden_size, 2 * width, bias=bias, ops=ops)
        self.down_proj = RowInvariantLinear(width, hidden_size, bias=bias, ops=ops)
        self.act_mul = ops.gelu_tanh_mul if gelu else ops.silu_mul

    @property
    def input_proj(self) -> RowInvariantLinear:
        return self.gate_up_proj

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:  # (M, 2I) -> (M, I), elementwise per row
        if self.clamped is None:
            return self.act_mul(gate_up)
        return clamped_swiglu(gate_up, *self.clamped, self.ops.sigmoid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (M, H) -> (M, H)
        return self.down_proj(self.activate(self.gate_up_proj(x)))


class SquaredReluMLP(nn.Module):
    """Nemotron-H's MLP and experts: down(relu(up(x))^2), no gate."""

    def __init__(self, hidden_size: int, width: int, ops: KernelBackend) -> None:
        super().__init__()
        self.up_proj = RowInvariantLinear(hidden_size, width, bias=False, ops=ops)
        self.down_proj = RowInvariantLinear(width, hidden_size, bias=False, ops=ops)

    @property
    def input_proj(self) -> RowInvariantLinear:
        return self.up_proj

    @staticmethod
    def activate(up: torch.Tensor) -> torch.Tensor:  # (M, I) -> (M, I)
        h = torch.relu(up)
        return h * h  # an exactly rounded product: the same bits in any batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (M, H) -> (M, H)
        return self.down_proj(self.activate(self.up_proj(x)))


def route(logits: torch.Tensor, top_k: int, renormalise: bool,
          sigmoid: Callable[[torch.Tensor], torch.Tensor] | None = None, bias: torch.Tensor | None = None,
          scale: float = 1.0, groups: tuple[int, int] = (1, 1), eps: float = 0.0,
          topk_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits -> fp32 weights and expert ids (T, k), best first.

    Scores, fp32: softmax over all experts (Mixtral, Qwen, Granite), or with `sigmoid` (the backend's) a sigmoid
    per expert (LFM2-MoE, Nemotron-H). `bias` (LFM2-MoE's expert_bias, Nemotron-H's correction bias) shifts the
    scores only to choose the k. `groups` = (n, m): only experts of the m groups (of n) whose two best biased
    scores sum highest are eligible (Nemotron-H, DeepSeek-V3's router). The k weights are the unbiased scores;
    `renormalise` divides them by their sum + `eps` (LFM2-MoE 1e-6, Nemotron-H 1e-20, as transformers has
    them), then `scale` multiplies them. With `topk_softmax` (GPT-OSS) the k best logits are chosen first and
    the weights are the softmax over those k only. Every op is per row, so a row's routing does not depend on
    the rows beside it.
    """
    if topk_softmax:
        best = logits.float().topk(top_k, dim=-1)  # (T, k)
        return torch.softmax(best.values, dim=-1), best.indices
    scores = torch.softmax(logits.float(), dim=-1) if sigmoid is None else sigmoid(logits.float())  # (T, E)
    choice = scores if bias is None else scores + bias
    num_groups, topk_groups = groups
    if num_groups > 1:
        num_tokens, num_experts = scores.shape
        per_group = num_experts // num_groups
        best = choice.view(num_tokens, num_groups, per_group).topk(2, dim=-1).values.sum(-1).topk(topk_groups, dim=-1)
        keep = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=scores.device)
        keep.scatter_(1, best.indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    expert_ids = choice.topk(top_k, dim=-1).indices  # (T, k)
    weights = scores.gather(-1, expert_ids)
    if renormalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    return (weights if scale == 1.0 else weights * scale), expert_ids


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.ops = ops
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.renormalise, self.renorm_eps = config.norm_topk_prob, config.moe_renorm_eps
        self.sigmoid_scores = config.moe_scoring == "sigmoid"
        self.groups = (config.moe_num_groups, config.moe_topk_groups)
        self.scale = config.routed_scaling_factor
        self.use_expert_bias = config.moe_expert_bias
        self.topk_softmax = config.moe_scoring == "topk_softmax"  # GPT-OSS
        self.linear_bias = config.moe_linear_bias
        self.expert_bias: torch.Tensor | None = None  # (E,) fp32, loaded
        self.expert_scale: torch.Tensor | None = None  # (E,): a chosen expert's weight times it (Gemma 4), loaded
        # SwiGLU experts, or Nemotron-H's relu^2 ones (no gate); a shared expert has the same shape
        self.parts = ("up", "down") if config.hidden_act == "relu2" else ("gate", "up", "down")
        expert = SquaredReluMLP if config.hidden_act == "relu2" else ExpertMLP
        if config.moe_activation == "swiglu_oai":  # GPT-OSS: biased experts, clamped SwiGLU
            expert = partial(ExpertMLP, bias=True, clamped=(config.swiglu_alpha, config.swiglu_limit))
        elif config.hidden_act == "gelu_tanh":  # Gemma 4's GeGLU experts
            expert = partial(ExpertMLP, gelu=True)
        self.experts = nn.ModuleList(expert(config.hidden_size, config.moe_intermediate_size, ops)
                                     for _ in range(config.num_experts))
        shared = config.shared_expert_intermediate_size
        # All experts' GEMMs in one call per projection where they run quantized alike (set at load);
        # None runs the per-expert loop (bf16 / HF weights, mixed types; tests set it to compare the two).
        self.grouped: GroupedExperts | None = None
        self.shared_expert = expert(config.hidden_size, shared, ops) if shared else None
        self.shared_gate = bool(shared) and config.shared_expert_gate
        self.weight_input = config.moe_weight_input  # Llama 4: weights scale the experts' inputs
        # The router; a shared expert's gate rides along as one more output row (one small GEMM, not two).
        self.gate = RowInvariantLinear(config.hidden_size, config.num_experts + (1 if self.shared_gate else 0),
                                       bias=self.linear_bias, ops=ops)

    def forward(self, x: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:  # (T, H) -> (T, H)
        """`router_input`: what the router reads where it is not the experts' input (Gemma 4)."""
        num_tokens, k = x.shape[0], self.top_k
        logits = self.gate(x if router_input is None else router_input)  # (T, E [+ 1])
        weights, expert_ids = route(logits[:, :self.num_experts], k, self.renormalise,
                                    self.ops.sigmoid if self.sigmoid_scores else None, self.expert_bias,
                                    self.scale, self.groups, self.renorm_eps, self.topk_softmax)  # (T, k) each
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[expert_ids].float()
        flat = expert_ids.flatten()  # (T*k,): assignment t*k + r
        order = flat.argsort(stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # one host sync per layer
        inputs = x[order // k]  # (T*k, H): each assignment's row, grouped
        if self.weight_input:  # Llama 4: x * weight in the model dtype, as transformers' routed_in
            inputs = inputs * weights.flatten()[order].to(x.dtype)[:, None]
        outputs = self._run_experts(inputs, counts)  # (T*k, H)
        by_rank = torch.empty_like(outputs)
        by_rank[order] = outputs
        by_rank = by_rank.view(num_tokens, k, x.shape[1])  # (T, k, H)
        weighted = by_rank.float() if self.weight_input else by_rank.float() * weights.unsqueeze(-1)  # (T, k, H)
        # NOTE: the fixed per-row order of this sum (rank 0, 1, ...) is what keeps rows batch-invariant.
        y = weighted[:, 0]
        for r in range(1, k):
            y = y + weighted[:, r]
        y = y.to(x.dtype)
        if self.shared_expert is not None:  # + shared(x), times sigmoid(gate . x) where gated (Qwen3-Next, Qwen3.5-MoE)
            shared = self.shared_expert(x)
            y = y + (shared * self.ops.sigmoid(logits[:, self.num_experts:]) if self.shared_gate else shared)
        return y

    def _run_experts(self, inputs: torch.Tensor, counts: list[int]) -> torch.Tensor:  # (A, H) grouped -> (A, H)
        """`inputs`: rows grouped by expert, counts[e] for expert e: one grouped GEMM per projection where the
        experts allow it (moe_grouped.py), else two GEMMs per expert hit; the same bits either way."""
        if self.grouped is not None:
            return self.grouped(inputs, counts)
        outputs = torch.empty_like(inputs)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                outputs[start:start + count] = expert(inputs[start:start + count])
                start += count
        return outputs

    def load(self, get: Callable[[str], Weight], prefix: str, names: ExpertNames, loader: WeightLoader) -> None:
        """Router and experts from HF names under the layer's `prefix` (`model.layers.N.`)."""
        # The router stays in the model dtype, never quantized (not even under --weight-dtype int8): routing
        # decisions are sensitive, and llama.cpp keeps ffn_gate_inp in F32 for the same reason.
        router = loader.dense(get(names.router(prefix)))
        if self.shared_gate:
            router = torch.cat([router, loader.dense(get(names.shared_gate(prefix)))])
        if self.shared_expert is not None:
            _load_expert(self.shared_expert, [get(names.shared(prefix, part)) for part in self.parts], loader)
        self.gate.load_dense(router, loader.dense(get(names.router_bias(prefix))) if self.linear_bias else None)
        self.gate.prepack()
        for e, expert in enumerate(self.experts):
            biases = ([get(names.expert_linear_bias(prefix, e, part)) for part in self.parts] if self.linear_bias
                      else None)
            _load_expert(expert, [get(names.expert(prefix, e, part)) for part in self.parts], loader, biases)
        if self.use_expert_bias:  # fp32, as transformers keeps this buffer whatever the model dtype
            self.expert_bias = get(names.expert_bias(prefix)).to(loader.device, torch.float32)
        self.grouped = group_experts(self.experts, self.ops)


def _load_expert(expert: nn.Module, parts: list[Weight], loader: WeightLoader,
                 biases: list[Weight] | None = None) -> None:
    """(gate,) up and down weights (and GPT-OSS's biases, the same parts); gate|up fused into one GEMM (SwiGLU),
    up alone (relu^2)."""
    *inputs, down = parts
    input_bias, down_bias = (biases[:-1], biases[-1:]) if biases is not None else (None, None)
    loader.linear(expert.gate_up_proj if len(inputs) == 2 else expert.up_proj, inputs, input_bias)
    loader.linear(expert.down_proj, [down], down_bias)
