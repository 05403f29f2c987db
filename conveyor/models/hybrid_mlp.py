"""Channel mixers of the hybrid models (models/hybrid.py): MLPs and mixtures of experts, with the mixer
interface of hybrid_base.py. They keep nothing between steps."""

from __future__ import annotations

import torch

from conveyor.kernels import KernelBackend
from conveyor.models.cache_specs import CacheSpec
from conveyor.models.config import ModelConfig
from conveyor.models.hybrid_base import Getter, LayerContext, NormGetter, fp32_param, scaled
from conveyor.models.llama import LlamaMLP
from conveyor.models.moe import SigmoidMoeBlock, SparseMoeBlock, SquaredReluMLP
from conveyor.models.weights import WeightLoader


class _Stateless:
    cache_index: int = -1

    def cache_spec(self) -> CacheSpec | None:
        return None


class GatedMLP(_Stateless, LlamaMLP):
    """SwiGLU / GeGLU; gate and up apart or fused (Granite's input_linear), Falcon-H1's multipliers folded in."""

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__(config, ops)
        self.gate_scale, self.down_scale = config.mlp_gate_multiplier, config.mlp_down_multiplier

    def forward(self, x: torch.Tensor, ctx: LayerContext | None = None) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)

    def load(self, get: Getter, prefix: str, names: dict[str, str], loader: WeightLoader, norm: NormGetter) -> None:
        if "gate_up" in names:
            parts = [get(f"{prefix}{names['gate_up']}.weight")]
        else:  # silu(m * gate(x)) = silu((m * W_gate) x)
            parts = [scaled(get(f"{prefix}{names['gate']}.weight"), self.gate_scale),
                     get(f"{prefix}{names['up']}.weight")]
        loader.linear(self.gate_up_proj, parts)
        loader.linear(self.down_proj, [scaled(get(f"{prefix}{names['down']}.weight"), self.down_scale)])


class SquaredReluMixer(_Stateless, SquaredReluMLP):
    """Nemotron-H's MLP layers."""

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, ops)

    def forward(self, x: torch.Tensor, ctx: LayerContext | None = None) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)

    def load(self, get: Getter, prefix: str, names: dict[str, str], loader: WeightLoader, norm: NormGetter) -> None:
        loader.linear(self.up_proj, [get(f"{prefix}{names['up']}.weight")])
        loader.linear(self.down_proj, [get(f"{prefix}{names['down']}.weight")])


class StackedExpertsMixer(_Stateless, SparseMoeBlock):
    """Granite 4.0-H's experts: softmax top-k, SwiGLU experts whose weights come stacked, (E, 2I, H) gate|up
    and (E, H, I) down."""

    def forward(self, x: torch.Tensor, ctx: LayerContext | None = None) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)

    def load(self, get: Getter, prefix: str, names: dict[str, str], loader: WeightLoader,  # type: ignore[override]
             norm: NormGetter) -> None:
        self.load_router(get(f"{prefix}{names['router']}.weight"), loader)
        gate_up, down = get(f"{prefix}{names['gate_up']}.weight"), get(f"{prefix}{names['down']}.weight")
        for e, expert in enumerate(self.experts):
            loader.linear(expert.gate_up_proj, [gate_up[e]])
            loader.linear(expert.down_proj, [down[e]])


class SigmoidExpertsMixer(_Stateless, SigmoidMoeBlock):
    """Nemotron-H's MoE layers: routed relu^2 experts, their correction bias, and the shared expert."""

    def forward(self, x: torch.Tensor, ctx: LayerContext | None = None) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)

    def load(self, get: Getter, prefix: str, names: dict[str, str], loader: WeightLoader,  # type: ignore[override]
             norm: NormGetter) -> None:
        router = f"{prefix}{names['router']}"
        self.load_router(get(f"{router}.weight"), loader)
        self.correction_bias = fp32_param(loader, get(f"{router}.e_score_correction_bias"))
        experts, shared = f"{prefix}{names['experts']}", f"{prefix}{names['shared']}"
        for e, expert in enumerate(self.experts):
            loader.linear(expert.up_proj, [get(f"{experts}.{e}.{names['up']}.weight")])
            loader.linear(expert.down_proj, [get(f"{experts}.{e}.{names['down']}.weight")])
        loader.linear(self.shared_expert.up_proj, [get(f"{shared}.{names['up']}.weight")])
        loader.linear(self.shared_expert.down_proj, [get(f"{shared}.{names['down']}.weight")])
