"""Channel mixers of the hybrid models (models/hybrid.py): MLPs and mixtures of experts, with the mixer
interface of hybrid_base.py. They keep nothing between steps."""

from __future__ import annotations

import torch

from conveyor.kernels import KernelBackend
from conveyor.models.cache_specs import CacheSpec
from conveyor.models import family as families
from conveyor.models.config import ModelConfig
from conveyor.models.hybrid_base import Getter, LayerContext, NormGetter, scaled
from conveyor.models.llama import LlamaMLP
from conveyor.models.moe import SparseMoeBlock, SquaredReluMLP
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


class MoEMixer(_Stateless, SparseMoeBlock):
    """A sparse MoE channel mixer (models/moe.py): its tensors are the family's expert_names under the layer's
    prefix (Granite's stacked experts split per expert at load: checkpoint.unstack_experts)."""

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__(config, ops)
        self.expert_names = families.expert_names(config.architecture)

    def forward(self, x: torch.Tensor, ctx: LayerContext | None = None) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)

    def load(self, get: Getter, prefix: str, names: dict[str, str], loader: WeightLoader,  # type: ignore[override]
             norm: NormGetter) -> None:
        super().load(get, prefix, self.expert_names, loader)
