"""Llama-family decoders whose MLPs are sparse mixtures of experts: Mixtral, Qwen3-MoE, OLMoE, Llama 4, GPT-OSS.

What differs from models/llama.py is config: the attention is Llama's (Mixtral), Qwen3's with per-head
QK-norm (Qwen3-MoE), with one QK-norm over the whole projection (OLMoE: `qk_norm_scope="full"`), Llama 4's
(models/llama4.py: interleaved rotary, NoPE layers with a temperature, q/k L2-norm) or GPT-OSS's
(models/gpt_oss.py: biases, attention sinks, alternating sliding windows);
the sparse layers' MLP is models/moe.py's block, loaded from the family's checkpoint names.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from conveyor.kernels import KernelBackend
from conveyor.models import family as families
from conveyor.models.config import ModelConfig
from conveyor.models.llama import LlamaForCausalLM
from conveyor.models.moe import SparseMoeBlock
from conveyor.models.tensors import Weight
from conveyor.models.weights import WeightLoader


class MoEForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__(config, ops)
        self.expert_names = families.expert_names(config.architecture)
        for i, layer in enumerate(self.layers):
            if config.is_moe_layer(i):  # the dense MLP built above is a meta placeholder: nothing to free
                layer.mlp = SparseMoeBlock(config, ops)

    def _load_mlp(self, mlp: nn.Module, get: Callable[[str], Weight], prefix: str, loader: WeightLoader,
                  fused) -> None:
        if isinstance(mlp, SparseMoeBlock):
            mlp.load(get, prefix, self.expert_names, loader)
        else:  # Qwen3-MoE's mlp_only_layers / decoder_sparse_step
            super()._load_mlp(mlp, get, prefix, loader, fused)
