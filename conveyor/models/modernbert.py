"""ModernBERT encoders (embedders): transformers' ModernBertModel, pre-LN with rotary positions.

    embeddings: tok_embeddings, LayerNorm (no position table: rotary on q and k)
    each layer: x = x + Wo(attention(rope(Wqkv(LN(x))))); x = x + Wo(gelu(input) * gate), input|gate = Wi(LN(x))
    final_norm after the last layer; layer 0 has no attention LayerNorm; LayerNorms without bias (norm_bias=False)

Every `global_attn_every_n_layers`-th layer (0, 3, 6, ...) attends globally, with rope base `global_rope_theta`;
the others attend a bidirectional window: row i sees keys j with |i - j| <= local_attention / 2 (transformers'
sliding_window), with rope base `local_rope_theta`.

Every layer attends as the other encoders do (models/encoder_attention.py), straight from this forward's q, k, v
(the whole sequence is always in one forward): one sequence at a time, in query chunks against the keys they
reach (the whole text on global layers, the band on local ones), in fp32 on fresh copies, so a row's bits depend
on its own sequence only. (The paged kernel's window is the last `window` keys up to a row's position: a
symmetric band cannot be said that way.) Local layers keep no K/V (cache_specs lists the global layers only).

A ModernBertForSequenceClassification checkpoint (gte-reranker-modernbert) is a cross-encoder: its head reads the
pooled row (config.classifier_pooling: the first token's or the mean of all) as out(LayerNorm(gelu(dense(row)))).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from conveyor.kernels import AttentionMetadata, KernelBackend
from conveyor.models.cache_specs import CacheSpec, KVSpec
from conveyor.models.config import ModelConfig
from conveyor.models.encoder_attention import sequence_attention
from conveyor.models.family import Family, gguf_layer_types, register
from conveyor.models.layers import LayerNorm, RotaryEmbedding, RowInvariantLinear
from conveyor.models.tensors import Weight
from conveyor.models.weights import WeightLoader, tensor_getters

KVCache = tuple[torch.Tensor, torch.Tensor]  # (num_blocks, block_size, kv_heads, head_dim) each

EMBEDDINGS = "embeddings."
# ModernBertForSequenceClassification's head: ModernBertPredictionHead (dense, gelu, LayerNorm without bias), then
# `classifier` to the labels; dropout sits between them, off at inference. (ModernBertForMaskedLM has the same
# `head.` but no `classifier.`: only a checkpoint with `classifier.weight` scores.)
HEAD_DENSE, HEAD_NORM, CLASSIFIER = "head.dense.", "head.norm.", "classifier."


def _layer(i: int) -> str:
    return f"layers.{i}."


class ModernBertAttention(nn.Module):
    """Fused Wqkv, rotary (in fp32, rounded once, as transformers), global or bidirectional-window attention, Wo."""

    def __init__(self, config: ModelConfig, layer: int, ops: KernelBackend) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        hidden, width = config.hidden_size, config.num_attention_heads * config.head_dim
        self.qkv_proj = RowInvariantLinear(hidden, 3 * width, config.attention_bias, ops)
        self.o_proj = RowInvariantLinear(width, hidden, config.attention_bias, ops)
        self.half_window = config.window(layer)  # 0: global
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache | None,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, 3 * self.num_heads, self.head_dim)  # (T, 3H, D)
        q, k, v = qkv.split(self.num_heads, dim=1)  # (T, H, D) each
        q, k = (RotaryEmbedding.apply(t.float(), *rope).to(x.dtype) for t in (q, k))
        out = sequence_attention(q, k, v, meta.seq_token_counts, self.scale, self.half_window)  # (T, H, D)
        return self.o_proj(out.reshape(num_tokens, -1))


class ModernBertMLP(nn.Module):
    """GeGLU: Wi gives input|gate, Wo(gelu(input) * gate), the exact GELU rounded before the product."""

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.ops = ops
        hidden, inter = config.hidden_size, config.intermediate_size
        self.up_proj = RowInvariantLinear(hidden, 2 * inter, config.mlp_bias, ops)
        self.down_proj = RowInvariantLinear(inter, hidden, config.mlp_bias, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.gelu_erf_mul(self.up_proj(x)))


class ModernBertLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, ops: KernelBackend) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.attn_norm = LayerNorm(config.hidden_size, eps, bias=False) if layer else None  # layer 0: identity
        self.attention = ModernBertAttention(config, layer, ops)
        self.mlp_norm = LayerNorm(config.hidden_size, eps, bias=False)
        self.mlp = ModernBertMLP(config, ops)


@dataclass(frozen=True)
class ClassifierHead:
    """A cross-encoder's head in fp32. It sees one pooled row per text, so plain torch ops are row-invariant here."""

    dense_weight: torch.Tensor  # (hidden, hidden)
    dense_bias: torch.Tensor | None  # classifier_bias (False in the released rerankers)
    norm_weight: torch.Tensor  # (hidden,): norm_bias is refused (hf_fields)
    out_weight: torch.Tensor  # (labels, hidden)
    out_bias: torch.Tensor  # (labels,)
    eps: float

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """pooled (R, hidden) -> logits (R, labels), fp32."""
        x = nn.functional.gelu(nn.functional.linear(pooled.float(), self.dense_weight, self.dense_bias))
        x = nn.functional.layer_norm(x, x.shape[-1:], self.norm_weight, None, self.eps)
        return nn.functional.linear(x, self.out_weight, self.out_bias)


class ModernBertModel(nn.Module):
    """The encoder's last hidden states (after final_norm) for pooling (models/pooling.py); it has no LM head."""

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        hidden, positions = config.hidden_size, config.max_position_embeddings
        self.embed_tokens: nn.Module = nn.Embedding(config.vocab_size, hidden, device="meta")  # assigned at load
        self.embed_norm = LayerNorm(hidden, config.layer_norm_eps, bias=False)
        self.layers = nn.ModuleList(ModernBertLayer(config, i, ops) for i in range(config.num_hidden_layers))
        self.final_norm = LayerNorm(hidden, config.layer_norm_eps, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, positions, config.rope_theta, None)
        self.local_rotary = RotaryEmbedding(config.head_dim, positions, config.local_rope_theta, None)
        self.classifier: ClassifierHead | None = None  # set at load when the checkpoint has one (a cross-encoder)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(f"{self.config.architecture} is an encoder without an LM head: it cannot generate "
                                  f"logits, only pool its hidden states (hidden_states)")

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                      meta: AttentionMetadata, rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (T,) -> the final-normed output (len(rows), hidden) at the token rows `rows`, in the
        model dtype. Whole sequences only; `meta.token_pos` is each sequence's last position on all its rows."""
        x = self.embed_norm(self.embed_tokens(input_ids))  # (T, hidden)
        # cos and sin rounded to the model dtype, as transformers hands them to its fp32 rotary
        global_rope, local_rope = (tuple(t.float() for t in rotary.tables(positions, x.dtype))
                                   for rotary in (self.rotary, self.local_rotary))
        caches: Iterator[KVCache] = iter(kv_caches)  # the global layers', in order
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            attn = layer.attention
            normed = x if layer.attn_norm is None else layer.attn_norm(x)
            if attn.half_window:
                x = x + attn(normed, local_rope, None, meta)
            else:
                x = x + attn(normed, global_rope, next(caches), meta)
            if i == last:  # the MLP and final norm are per row: only the pooled rows need them
                x = x[rows]
            x = x + layer.mlp(layer.mlp_norm(x))
        return self.final_norm(x)

    @property
    def has_classifier(self) -> bool:
        return self.classifier is not None

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """A cross-encoder's logits (R, labels) from each text's pooled row (R, hidden), pooled as
        config.classifier_pooling says (engine/pooling_setup.py)."""
        return self.classifier(pooled)

    def load_weights(self, weights: Mapping[str, Weight], loader: WeightLoader) -> None:
        """Fill the model from transformers' names (a task model's `model.` prefix already stripped)."""
        get, _ = tensor_getters(weights, loader, 0.0)
        cfg = self.config

        def linear(module: RowInvariantLinear, name: str, bias: bool) -> None:
            loader.linear(module, [get(name + ".weight")], [get(name + ".bias")] if bias else None)

        self.embed_tokens = loader.embedding(get(EMBEDDINGS + "tok_embeddings.weight"))
        self.embed_norm.weight = loader.param(get(EMBEDDINGS + "norm.weight"))
        for i, layer in enumerate(self.layers):
            p = _layer(i)
            if layer.attn_norm is not None:
                layer.attn_norm.weight = loader.param(get(p + "attn_norm.weight"))
            linear(layer.attention.qkv_proj, p + "attn.Wqkv", cfg.attention_bias)
            linear(layer.attention.o_proj, p + "attn.Wo", cfg.attention_bias)
            layer.mlp_norm.weight = loader.param(get(p + "mlp_norm.weight"))
            linear(layer.mlp.up_proj, p + "mlp.Wi", cfg.mlp_bias)
            linear(layer.mlp.down_proj, p + "mlp.Wo", cfg.mlp_bias)
        self.final_norm.weight = loader.param(get("final_norm.weight"))
        if CLASSIFIER + "weight" in weights:
            def fp32(name: str) -> torch.Tensor | None:
                return loader.dense(get(name)).float() if name in weights else None

            self.classifier = ClassifierHead(
                fp32(HEAD_DENSE + "weight"), fp32(HEAD_DENSE + "bias"), fp32(HEAD_NORM + "weight"),
                fp32(CLASSIFIER + "weight"), fp32(CLASSIFIER + "bias"), cfg.layer_norm_eps)

    def cache_specs(self) -> list[CacheSpec]:
        """K/V in the block pool for the global layers only (kept just for the forward that writes it)."""
        cfg = self.config
        return [KVSpec(cfg.num_key_value_heads, cfg.head_dim, 0)
                for layer in self.layers if not layer.attention.half_window]


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers' ModernBertConfig (config.json of transformers 4.48+ or 5) -> ModelConfig fields.

    sliding_window is the half window (transformers' own property): a local layer's row sees +-sliding_window."""
    if raw.get("norm_bias"):
        raise NotImplementedError("norm_bias (LayerNorm biases)")
    act = raw.get("hidden_activation", "gelu")
    if act != "gelu":
        raise NotImplementedError(f"hidden_activation {act!r}")
    head_act = raw.get("classifier_activation", "gelu")
    if "ModernBertForSequenceClassification" in (raw.get("architectures") or []) and head_act != "gelu":
        raise NotImplementedError(f"classifier_activation {head_act!r}")
    pooling = raw.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise NotImplementedError(f"classifier_pooling {pooling!r}")
    hidden, heads, layers = int(raw["hidden_size"]), int(raw["num_attention_heads"]), int(raw["num_hidden_layers"])
    every = int(raw.get("global_attn_every_n_layers", 3))
    types = raw.get("layer_types") or ["sliding_attention" if i % every else "full_attention" for i in range(layers)]
    bias = bool(raw.get("attention_bias", False))
    return dict(
        num_key_value_heads=heads, head_dim=hidden // heads, hidden_act="gelu", bidirectional=True,
        attention_bias=bias, attention_out_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)),
        tie_word_embeddings=False, layer_norm_eps=float(raw.get("norm_eps", 1e-5)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
        sliding_window=int(raw.get("local_attention", 128)) // 2, layer_types=tuple(types), **_rope(raw),
        classifier_pooling=pooling,
    )


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    """Global and local rope bases: transformers 5 nests them per layer type in rope_parameters; older files
    keep global_rope_theta and local_rope_theta."""
    params = raw.get("rope_parameters") or {}
    full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    for kind in (full, local, raw.get("rope_scaling") or {}):
        rope_type = kind.get("rope_type", kind.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"rope_type {rope_type!r}")
    return dict(rope_theta=float(full.get("rope_theta", raw.get("global_rope_theta", 160_000.0))),
                local_rope_theta=float(local.get("rope_theta", raw.get("local_rope_theta", 10_000.0))),
                rope_scaling=None)


def weight_names(config: ModelConfig) -> list[str]:
    """What ModernBertModel.load_weights reads, the token embeddings first (checkpoint.select_weights checks it)."""
    names = [EMBEDDINGS + "tok_embeddings.weight", EMBEDDINGS + "norm.weight"]
    for i in range(config.num_hidden_layers):
        p = _layer(i)
        names += [p + "attn_norm.weight"] if i else []
        parts = [(p + "attn.Wqkv", config.attention_bias), (p + "attn.Wo", config.attention_bias),
                 (p + "mlp.Wi", config.mlp_bias), (p + "mlp.Wo", config.mlp_bias)]
        names += [f"{name}.{kind}" for name, bias in parts for kind in ("weight", "bias")[:1 + bias]]
        names.append(p + "mlp_norm.weight")
    return names + ["final_norm.weight"]


def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    """convert_hf_to_gguf's ModernBertModel: sliding_window is the whole local window (local_attention), every
    sliding_window_pattern-th layer global from layer 0, the global rope base rope.freq_base and the local one
    freq_base_swa (llama.cpp's default: the global one); norm_eps written as layer_norm_rms_epsilon (the
    LayerNorms are plain ones). The classifier head (ModernBertForSequenceClassification's) is refused."""
    act = meta("hidden_activation", "gelu")
    if act != "gelu":
        raise ValueError(f"hidden_activation {act!r} (supported: gelu)")
    head = sorted({"cls.weight", "cls.output.weight", "cls.norm.weight"} & tensors.keys())
    if head:
        raise ValueError(f"ModernBERT's classifier head ({', '.join(head)}: a cross-encoder) is not supported in "
                         f"GGUF; its Hugging Face directory (ModernBertForSequenceClassification) is")
    layers, window = base["num_hidden_layers"], int(meta("attention.sliding_window", 0) or 0)
    types = (gguf_layer_types(meta("attention.sliding_window_pattern"), layers, 3, global_first=True) if window
             else ("full_attention",) * layers)
    eps = meta("attention.layer_norm_epsilon") or meta("attention.layer_norm_rms_epsilon") or 1e-5
    bias = "blk.0.attn_qkv.bias" in tensors
    return dict(
        num_key_value_heads=base["num_attention_heads"], hidden_act="gelu", bidirectional=True,
        attention_bias=bias, attention_out_bias=bias, mlp_bias="blk.0.ffn_up.bias" in tensors,
        tie_word_embeddings=False, layer_norm_eps=float(eps), sliding_window=window // 2 or None, layer_types=types,
        local_rope_theta=float(meta("rope.freq_base_swa", base["rope_theta"])), rope_scaling=None)


# llama.cpp's names for transformers' (without a task model's `model.` prefix): whole tensors and, per `blk.N.`,
# those of layers.N
GGUF_TENSORS = {"token_embd": EMBEDDINGS + "tok_embeddings", "token_embd_norm": EMBEDDINGS + "norm",
                "output_norm": "final_norm", "attn_norm": "attn_norm", "attn_qkv": "attn.Wqkv",
                "attn_output": "attn.Wo", "ffn_norm": "mlp_norm", "ffn_up": "mlp.Wi", "ffn_down": "mlp.Wo"}

# ModernBertFor* checkpoints (MaskedLM, SequenceClassification) keep the encoder under `model.`.
register(Family("modernbert", "conveyor.models.modernbert:ModernBertModel", hf_fields, weight_renames={"model.": ""},
                weight_names=weight_names, optional_weights=(
                    HEAD_DENSE + "weight", HEAD_DENSE + "bias", HEAD_NORM + "weight", CLASSIFIER + "weight",
                    CLASSIFIER + "bias"),
                gguf_architectures=("modern-bert",), gguf_fields=gguf_fields, gguf_tensors=GGUF_TENSORS,
                gguf_layer_prefix="layers."))
