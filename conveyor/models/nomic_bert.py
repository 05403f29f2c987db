"""NomicBERT encoders (nomic-embed-text v1 / v1.5): transformers' NomicBertModel, post-LN BERT with rotary positions.

    embeddings: word + token type (0), LayerNorm (no position table: rotary on q and k)
    each layer: x = LN(x + o(attention(rope(q, k), v))); x = LN(x + down(silu(gate(x)) * up(x)))

No linear has a bias; the LayerNorms have. Checkpoints keep nomic's own names (transformers 5 saves them so too,
converting only in memory): emb_ln, encoder.layers.N.attn.Wqkv (q|k|v), mlp.fc11 (up), fc12 (gate), fc2, norm1,
norm2; gate|up is fused at load. Attention is BERT's (models/encoder_attention.py: each row attends all of its text,
from this forward's q, k, v), after rotary on q and k, rounding after each op as transformers' rotary does.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from conveyor.kernels import AttentionMetadata, KernelBackend
from conveyor.models.cache_specs import CacheSpec, KVSpec
from conveyor.models.config import ModelConfig
from conveyor.models.encoder_attention import sequence_attention
from conveyor.models.family import Family, register
from conveyor.models.layers import LayerNorm, RotaryEmbedding, RowInvariantLinear
from conveyor.models.tensors import Weight
from conveyor.models.weights import WeightLoader, tensor_getters

KVCache = tuple[torch.Tensor, torch.Tensor]  # (num_blocks, block_size, kv_heads, head_dim) each
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin: (T, 1, D) each

EMBEDDINGS = "embeddings."
EMBED_NORM = "emb_ln"
GATE_UP = ("mlp.fc12", "mlp.fc11")  # gate, up: silu_mul's order
LINEARS = ("attn.Wqkv", "attn.out_proj", *GATE_UP, "mlp.fc2")
NORMS = ("norm1", "norm2")  # after attention, after the MLP


def _layer(i: int) -> str:
    return f"encoder.layers.{i}."


class NomicBertAttention(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        width = self.num_heads * self.head_dim
        self.qkv_proj = RowInvariantLinear(config.hidden_size, 3 * width, False, ops)
        self.o_proj = RowInvariantLinear(width, config.hidden_size, False, ops)
        self.norm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, 3 * H * D)
        qk, v = qkv.view(num_tokens, 3 * self.num_heads, self.head_dim).split([2 * self.num_heads, self.num_heads],
                                                                              dim=1)
        q, k = RotaryEmbedding.apply(qk, *rope).split(self.num_heads, dim=1)  # (T, H, D) each
        out = sequence_attention(q, k, v, meta.seq_token_counts, self.scale)  # (T, H, D): all of its text
        return self.norm(x + self.o_proj(out.reshape(num_tokens, -1)))


class NomicBertMLP(nn.Module):
    """SwiGLU (GELU-gated where hidden_act is gelu), then residual and LayerNorm."""

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.gate_up_proj = RowInvariantLinear(config.hidden_size, 2 * config.intermediate_size, False, ops)
        self.down_proj = RowInvariantLinear(config.intermediate_size, config.hidden_size, False, ops)
        self.act_mul = ops.gelu_erf_mul if config.hidden_act == "gelu" else ops.silu_mul
        self.norm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down_proj(self.act_mul(self.gate_up_proj(x))))


class NomicBertLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.attention = NomicBertAttention(config, ops)
        self.mlp = NomicBertMLP(config, ops)


class NomicBertModel(nn.Module):
    """The encoder's last hidden states for pooling (models/pooling.py); it has no LM head."""

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        hidden = config.hidden_size
        self.embed_tokens: nn.Module = nn.Embedding(config.vocab_size, hidden, device="meta")  # assigned at load
        self.token_type_embeddings = (nn.Parameter(torch.empty(config.type_vocab_size, hidden, device="meta"),
                                                   requires_grad=False) if config.type_vocab_size else None)
        self.embed_norm = LayerNorm(hidden, config.layer_norm_eps)
        self.layers = nn.ModuleList(NomicBertLayer(config, ops) for _ in range(config.num_hidden_layers))
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(f"{self.config.architecture} is an encoder without an LM head: it cannot generate "
                                  f"logits, only pool its hidden states (hidden_states)")

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                      meta: AttentionMetadata, rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (T,) -> the last layer's output (len(rows), hidden) at the token rows `rows`, in the
        model dtype. `meta.token_pos` must be each sequence's last position on all its rows (bidirectional)."""
        x = self.embed_tokens(input_ids)  # (T, hidden)
        if self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings[0]
        x = self.embed_norm(x)
        rope = self.rotary.tables(positions, x.dtype)
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer.attention(x, rope, kv_cache, meta)
            if i == last:  # the MLP is per row: only the pooled rows need the last one
                x = x[rows]
            x = layer.mlp(x)
        return x

    def load_weights(self, weights: Mapping[str, Weight], loader: WeightLoader) -> None:
        """Fill the model from nomic's names (a task model's `nomic_bert.` prefix already stripped); gate|up fused."""
        get, _ = tensor_getters(weights, loader, 0.0)

        def norm(module: LayerNorm, name: str) -> None:
            module.weight, module.bias = loader.param(get(name + ".weight")), loader.param(get(name + ".bias"))

        self.embed_tokens = loader.embedding(get(EMBEDDINGS + "word_embeddings.weight"))
        if self.token_type_embeddings is not None:
            self.token_type_embeddings = loader.param(get(EMBEDDINGS + "token_type_embeddings.weight"))
        norm(self.embed_norm, EMBED_NORM)
        for i, layer in enumerate(self.layers):
            p = _layer(i)
            attn, mlp = layer.attention, layer.mlp
            loader.linear(attn.qkv_proj, [get(p + "attn.Wqkv.weight")])
            loader.linear(attn.o_proj, [get(p + "attn.out_proj.weight")])
            norm(attn.norm, p + NORMS[0])
            loader.linear(mlp.gate_up_proj, [get(f"{p}{n}.weight") for n in GATE_UP])
            loader.linear(mlp.down_proj, [get(p + "mlp.fc2.weight")])
            norm(mlp.norm, p + NORMS[1])

    def cache_specs(self) -> list[CacheSpec]:
        """K/V in the block pool for every layer (kept only for the forward that writes it)."""
        cfg = self.config
        return [KVSpec(cfg.num_key_value_heads, cfg.head_dim, 0) for _ in range(cfg.num_hidden_layers)]


# nomic's own config.json (trust_remote_code) names -> transformers' NomicBertConfig names
_REMOTE_NAMES = {"n_embd": "hidden_size", "n_head": "num_attention_heads", "n_layer": "num_hidden_layers",
                 "n_inner": "intermediate_size", "n_positions": "max_position_embeddings",
                 "layer_norm_epsilon": "layer_norm_eps", "rotary_emb_base": "rope_theta"}


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers' NomicBertConfig -> ModelConfig fields (the remote-code config's n_embd, ... read as well)."""
    raw = {**{new: raw[old] for old, new in _REMOTE_NAMES.items() if old in raw and new not in raw}, **raw}
    # the gated MLP's activation (transformers' hidden_act; the remote code's swiglu / geglu)
    remote = raw.get("activation_function")
    act = raw.get("hidden_act") or {"swiglu": "silu", "geglu": "gelu"}.get(remote, remote or "silu")
    if act not in ("silu", "gelu"):
        raise NotImplementedError(f"activation {act!r}")
    # what the remote code can switch on and transformers' NomicBertModel cannot
    for key in ("qkv_proj_bias", "mlp_fc1_bias", "mlp_fc2_bias", "prenorm", "rotary_emb_interleaved",
                "rotary_scaling_factor"):
        if raw.get(key):
            raise NotImplementedError(key)
    if raw.get("moe_every_n_layers"):
        raise NotImplementedError("mixture-of-experts layers (nomic-embed-text-v2-moe)")
    if float(raw.get("rotary_emb_fraction", 1.0)) != 1.0:
        raise NotImplementedError("rotary_emb_fraction below 1")
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"rope_type {rope['rope_type']!r}")
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    return dict(
        vocab_size=int(raw["vocab_size"]), hidden_size=hidden, num_attention_heads=heads,
        num_hidden_layers=int(raw["num_hidden_layers"]),
        intermediate_size=int(raw.get("intermediate_size") or 4 * hidden),
        num_key_value_heads=heads, head_dim=int(raw.get("head_dim") or hidden // heads), hidden_act=act,
        bidirectional=True, tie_word_embeddings=False, rope_scaling=None,
        rope_theta=float(rope.get("rope_theta") or raw.get("rope_theta") or 1000.0),  # NomicBertConfig's default
        max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
        type_vocab_size=int(raw.get("type_vocab_size", 2)), layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
    )


def weight_names(config: ModelConfig) -> list[str]:
    """What NomicBertModel.load_weights reads, the word embeddings first (checkpoint.select_weights checks it)."""
    names = [EMBEDDINGS + "word_embeddings.weight"]
    if config.type_vocab_size:
        names.append(EMBEDDINGS + "token_type_embeddings.weight")
    names += [EMBED_NORM + ".weight", EMBED_NORM + ".bias"]
    for i in range(config.num_hidden_layers):
        p = _layer(i)
        names += [f"{p}{n}.weight" for n in LINEARS] + [f"{p}{n}.{kind}" for n in NORMS for kind in ("weight", "bias")]
    return names


def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    """convert_hf_to_gguf's NomicBertModel (nomic-embed-text v1 and v1.5; v2's experts are `nomic-bert-moe`): the
    remote code's config as the shared keys say it (context_length: the positions trained, 2048; rope.freq_base:
    rotary_emb_base), with what the converter asserts: SwiGLU, no linear biases, post-LN, rotary over whole heads."""
    if meta("attention.causal", False):
        raise ValueError("a causal nomic-bert model is not supported")
    biases = sorted(n for n in tensors if n.endswith(("attn_qkv.bias", "attn_output.bias", "ffn_up.bias",
                                                       "ffn_down.bias")))
    if biases:
        raise ValueError(f"linear biases ({biases[0]}, ...) are not supported")
    types = tensors.get("token_types.weight")
    return hf_fields(dict(
        vocab_size=base["vocab_size"], hidden_size=base["hidden_size"], num_attention_heads=base["num_attention_heads"],
        num_hidden_layers=base["num_hidden_layers"], intermediate_size=base["intermediate_size"],
        max_position_embeddings=base["max_position_embeddings"], rope_theta=base["rope_theta"], hidden_act="silu",
        type_vocab_size=types[1] if types is not None else 0,  # GGUF shapes are reversed
        layer_norm_eps=float(meta("attention.layer_norm_epsilon", 1e-12))))


# llama.cpp's names for nomic's: whole tensors and, per `blk.N.`, those of encoder.layers.N
GGUF_TENSORS = {"token_embd": EMBEDDINGS + "word_embeddings", "token_types": EMBEDDINGS + "token_type_embeddings",
                "token_embd_norm": EMBED_NORM, "attn_qkv": "attn.Wqkv", "attn_output": "attn.out_proj",
                "attn_output_norm": NORMS[0], "ffn_up": "mlp.fc11", "ffn_gate": "mlp.fc12", "ffn_down": "mlp.fc2",
                "layer_output_norm": NORMS[1]}

# NomicBertFor* checkpoints keep the encoder under `nomic_bert.`.
register(Family("nomic_bert", "conveyor.models.nomic_bert:NomicBertModel", hf_fields,
                weight_renames={"nomic_bert.": ""}, weight_names=weight_names, gguf_architectures=("nomic-bert",),
                gguf_fields=gguf_fields, gguf_tensors=GGUF_TENSORS, gguf_layer_prefix="encoder.layers."))
