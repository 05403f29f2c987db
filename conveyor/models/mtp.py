"""Qwen3.5 / Qwen3-Next multi-token prediction (MTP): the draft head their checkpoints carry beside the model.

One extra decoder layer (full attention, the model's own MLP or MoE block) reads, at position q, the target's
final hidden state h_q and the embedding of the token after it, x_{q+1}, and predicts x_{q+2}:

    x = fc([pre_fc_norm_embedding(embed(x_{q+1})) | pre_fc_norm_hidden(h_q)])      # (T, 2H) -> (T, H)
    out = norm(layer(x))                                                             # its own K/V at position q
    logits = lm_head(out)                                                            # the target's head

Drafting k tokens chains the head on its own output: `out` stands in for h at the next position. The embedding,
head and rotary tables are the target's (shared, not copied). The names are the Hugging Face checkpoints'
(mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.0.*, mtp.norm), as vLLM's
qwen3_next_mtp.py reads them; `h` is the target's hidden state after its final norm, as vLLM hands it over.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import torch
from torch import nn

from conveyor.kernels import AttentionMetadata, KernelBackend
from conveyor.models.cache_specs import CacheSpec
from conveyor.models.config import ModelConfig
from conveyor.models.draft_vocab import DraftVocabHead
from conveyor.models.hybrid import AttentionMixer, HybridDecoderLayer
from conveyor.models.hybrid_base import LayerContext
from conveyor.models.hybrid_layout import layer_prefix
from conveyor.models.layers import RMSNorm, RowInvariantLinear
from conveyor.models.tensors import Weight
from conveyor.models.weights import WeightLoader, tensor_getters

PREFIX = "mtp."
# The head's own tensors besides its layer (mtp.layers.0.*).
HEAD_TENSORS = ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


# llama.cpp's converter appends the head as block N = num_hidden_layers: its own tensors as blk.N.nextn.*, its layer
# under blk.N.* as any other block (norms stored as 1 + w, as the model's).
GGUF_NEXTN = {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden",
              "shared_head_norm": "norm"}


def has_mtp(weights: Mapping[str, Weight]) -> bool:
    return f"{PREFIX}fc.weight" in weights


def layer_config(config: ModelConfig) -> ModelConfig:
    """The target's config with the MTP layer appended as one more full-attention layer (index num_hidden_layers):
    the hybrid machinery then builds and names it as any other layer of the family."""
    types = config.layer_types or ("full_attention",) * config.num_hidden_layers
    return replace(config, num_hidden_layers=config.num_hidden_layers + 1, layer_types=(*types, "full_attention"))


def layer_weights(config: ModelConfig, weights: Mapping[str, Weight]) -> dict[str, Weight]:
    """The head's tensors with its layer under the appended layer's name (mtp.layers.0.* -> model.layers.L.*)."""
    layer = f"{PREFIX}layers.0."
    target = layer_prefix(layer_config(config), config.num_hidden_layers)
    return {(target + name[len(layer):] if name.startswith(layer) else name): w for name, w in weights.items()}


def from_gguf_block(config: ModelConfig, weights: Mapping[str, Weight]) -> dict[str, Weight]:
    """The appended block's tensors, renamed to HF names by the family's own renamer (model.layers.N.*, nextn.*
    still under blk.N.) -> the head's HF names (mtp.*). The converter's copies of the embedding and head
    (nextn.embed_tokens, nextn.shared_head_head) are the target's and dropped."""
    layer = layer_prefix(layer_config(config), config.num_hidden_layers)
    block = f"blk.{config.num_hidden_layers}.nextn."
    out = {}
    for name, weight in weights.items():
        if name.startswith(layer):
            out[f"{PREFIX}layers.0.{name[len(layer):]}"] = weight
        elif name.startswith(block):
            base, _, suffix = name[len(block):].rpartition(".")
            if base in GGUF_NEXTN:
                out[f"{PREFIX}{GGUF_NEXTN[base]}.{suffix}"] = weight
    return out


class MTPHead(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend, target: nn.Module) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.config, self.ops = layer_config(config), ops
        self.index = config.num_hidden_layers
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, ops)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, ops)
        self.fc = RowInvariantLinear(2 * hidden, hidden, False, ops)
        self.layer = HybridDecoderLayer(self.config, ops, self.index)
        self.norm = RMSNorm(hidden, eps, ops)
        self.draft_vocab: DraftVocabHead | None = None  # --draft-vocab: the head's rows for a subset of ids
        # NOTE: a tuple, not attributes: the target's modules must not count as this head's (weights, meta check).
        self._shared = (target,)
        self._specs: list[CacheSpec] = []
        for mixer in self.layer.mixers:
            if isinstance(mixer, AttentionMixer):
                mixer.cache_index = len(self._specs)
                self._specs.append(mixer.cache_spec())

    def cache_specs(self) -> list[CacheSpec]:
        return list(self._specs)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, caches: list,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids (T,): x_{q+1}; hidden (T, H): h_q; positions (T,): q -> the head's normed output (T, H)."""
        target = self._shared[0]
        embedded = self.pre_fc_norm_embedding(target.embed_tokens(input_ids))  # (T, H)
        x = self.fc(torch.cat([embedded, self.pre_fc_norm_hidden(hidden.to(embedded.dtype))], dim=-1))  # (T, H)
        rope = target.rotary.tables(positions, x.dtype) if target.rotary is not None else None
        delta, residual = self.layer(x, None, LayerContext(rope, caches, meta))
        _, out = self.norm.add_and_norm(residual, delta)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._shared[0].compute_logits(hidden)

    def draft_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What drafts are picked from: (logits (R, N), their target ids (N,)) over the draft vocabulary, or the
        full (R, V) logits and None without one."""
        if self.draft_vocab is None:
            return self.compute_logits(hidden), None
        return self._shared[0].scale_logits(self.draft_vocab(hidden)), self.draft_vocab.token_ids

    def load_weights(self, weights: Mapping[str, Weight], loader: WeightLoader) -> None:
        """From the checkpoint's mtp.* tensors (layer_weights' names)."""
        get, norm = tensor_getters(weights, loader, self.config.norm_weight_offset)
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            getattr(self, name).weight = norm(f"{PREFIX}{name}.weight")
        loader.linear(self.fc, [get(f"{PREFIX}fc.weight")])
        prefix = layer_prefix(self.config, self.index)
        for sub, layer_norm in zip(self.layer.plan, self.layer.norms):
            layer_norm.weight = norm(f"{prefix}{sub.norm}.weight")
        specs = [spec for sub in self.layer.plan for spec in sub.mixers]
        for spec, mixer in zip(specs, self.layer.mixers, strict=True):
            mixer.load(get, prefix + spec.prefix, spec.names, loader, norm)
