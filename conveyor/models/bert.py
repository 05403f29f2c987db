"""BERT and XLM-RoBERTa encoders (embedders and cross-encoders): transformers' BertModel, post-LN.

    embeddings: word + token type (0) + absolute position, LayerNorm
    each layer: x = LN(x + o(attention(qkv(x)))); x = LN(x + down(gelu(up(x))))

XLM-RoBERTa is the same network with positions counted from pad_token_id + 1. The whole sequence is always in one
forward, so each row attends all of its text straight from this forward's q, k, v (models/encoder_attention.py:
per text, on fresh fp32 copies, so bitwise the same alone or in any batch); nothing is kept in the K/V blocks.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch import nn

from conveyor.kernels import AttentionMetadata, KernelBackend
from conveyor.models.cache_specs import CacheSpec, KVSpec
from conveyor.models.config import ModelConfig, ModelConfigError
from conveyor.models.encoder_attention import sequence_attention
from conveyor.models.family import Family, register
from conveyor.models.layers import LayerNorm, RowInvariantLinear
from conveyor.models.tensors import Weight
from conveyor.models.weights import WeightLoader, tensor_getters

KVCache = tuple[torch.Tensor, torch.Tensor]  # (num_blocks, block_size, kv_heads, head_dim) each

logger = logging.getLogger(__name__)

# Checkpoint names (transformers' BertModel; BertFor*/XLMRobertaFor* prefix them with bert./roberta., which the
# families' weight_renames strip).
EMBEDDINGS = "embeddings."
POOLER = "pooler.dense."  # the CLS row's dense + tanh: kept when present (a BERT cross-encoder's head reads it)
QKV = ("query", "key", "value")
# XLMRobertaForSequenceClassification's head (bge-reranker): tanh(dense(first row)), then out_proj to the labels.
CLASSIFIER = ("classifier.dense.", "classifier.out_proj.")
# BertForSequenceClassification's (ms-marco MiniLM cross-encoders): the pooler's tanh(dense(first row)), then this.
BERT_CLASSIFIER = "classifier."


def _layer(i: int) -> str:
    return f"encoder.layer.{i}."


class BertAttention(nn.Module):
    """Self-attention with q/k/v fused into one GEMM at load, then output dense, residual and LayerNorm."""

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        hidden = config.hidden_size
        self.qkv_proj = RowInvariantLinear(hidden, 3 * self.num_heads * self.head_dim, True, ops)
        self.o_proj = RowInvariantLinear(self.num_heads * self.head_dim, hidden, True, ops)
        self.norm = LayerNorm(hidden, config.layer_norm_eps)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, 3 * self.num_heads, self.head_dim)  # (T, 3H, D)
        q, k, v = qkv.split(self.num_heads, dim=1)  # (T, H, D) each
        out = sequence_attention(q, k, v, meta.seq_token_counts, self.scale)  # (T, H, D): all of its text
        return self.norm(x + self.o_proj(out.reshape(num_tokens, -1)))


class BertMLP(nn.Module):
    """up, exact GELU, down, then residual and LayerNorm (BertIntermediate + BertOutput)."""

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.ops = ops
        self.up_proj = RowInvariantLinear(config.hidden_size, config.intermediate_size, True, ops)
        self.down_proj = RowInvariantLinear(config.intermediate_size, config.hidden_size, True, ops)
        self.norm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down_proj(self.ops.gelu_erf(self.up_proj(x))))


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.attention = BertAttention(config, ops)
        self.mlp = BertMLP(config, ops)


class BertModel(nn.Module):
    """The encoder's last hidden states for pooling (models/pooling.py); it has no LM head."""

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        hidden = config.hidden_size
        # Meta placeholders, assigned at load (the word embeddings may become GGML blocks: WeightLoader.embedding).
        self.embed_tokens: nn.Module = nn.Embedding(config.vocab_size, hidden, device="meta")
        self.position_embeddings = _placeholder(config.max_position_embeddings + config.position_offset, hidden)
        self.token_type_embeddings = _placeholder(config.type_vocab_size, hidden) if config.type_vocab_size else None
        self.embed_norm = LayerNorm(hidden, config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config, ops) for _ in range(config.num_hidden_layers))
        self.pooler: RowInvariantLinear | None = None  # set at load when the checkpoint has one
        # A cross-encoder's head, fp32 (weight, bias) pairs (set at load; None: an embedder). It sees one row per
        # text, so a plain matmul is row-invariant.
        self.classifier: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(f"{self.config.architecture} is an encoder without an LM head: it cannot generate "
                                  f"logits, only pool its hidden states (hidden_states)")

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                      meta: AttentionMetadata, rows: torch.Tensor,
                      token_types: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions (T,) -> the last layer's output (len(rows), hidden) at the token rows `rows`, in the
        model dtype. `meta.token_pos` must be each sequence's last position on all its rows (bidirectional)."""
        x = self._embed(input_ids, positions, token_types)  # (T, hidden)
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer.attention(x, kv_cache, meta)
            if i == last:  # the MLP is per row: only the pooled rows need the last one
                x = x[rows]
            x = layer.mlp(x)
        return x

    @property
    def has_classifier(self) -> bool:
        return self.classifier is not None

    def classify(self, first_rows: torch.Tensor) -> torch.Tensor:
        """A cross-encoder's logits (R, labels) from each text's first-token hidden state (R, hidden): tanh after
        every layer of the head but the last."""
        *hidden, (out_w, out_b) = self.classifier
        x = first_rows.float()
        for weight, bias in hidden:
            x = torch.tanh(nn.functional.linear(x, weight, bias))
        return nn.functional.linear(x, out_w, out_b)

    def _embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
               token_types: torch.Tensor | None) -> torch.Tensor:
        """transformers' order: (word + token type) + position, then LayerNorm; type 0 where `token_types` is None
        (a cross-encoder's pair has its second text as type 1)."""
        x = self.embed_tokens(input_ids)  # (T, hidden)
        if self.token_type_embeddings is not None:
            x = x + (self.token_type_embeddings[0] if token_types is None else self.token_type_embeddings[token_types])
        x = x + self.position_embeddings[positions + self.config.position_offset]
        return self.embed_norm(x)

    def load_weights(self, weights: Mapping[str, Weight], loader: WeightLoader) -> None:
        """Fill the model from transformers' names (prefix already stripped), one tensor at a time; q/k/v fused."""
        get, _ = tensor_getters(weights, loader, 0.0)

        def norm(module: LayerNorm, name: str) -> None:
            module.weight, module.bias = loader.param(get(name + ".weight")), loader.param(get(name + ".bias"))

        def linear(module: RowInvariantLinear, names: list[str]) -> None:
            loader.linear(module, [get(n + ".weight") for n in names], [get(n + ".bias") for n in names])

        self.embed_tokens = loader.embedding(get(EMBEDDINGS + "word_embeddings.weight"))
        positions = get(EMBEDDINGS + "position_embeddings.weight")
        # the engine limits inputs by the config: a shorter table would fail mid-forward
        if tuple(positions.shape) != tuple(self.position_embeddings.shape):
            raise ModelConfigError(f"position table {tuple(positions.shape)} does not match the config "
                                   f"{tuple(self.position_embeddings.shape)}")
        self.position_embeddings = loader.param(positions)
        if self.token_type_embeddings is not None:
            self.token_type_embeddings = loader.param(get(EMBEDDINGS + "token_type_embeddings.weight"))
        norm(self.embed_norm, EMBEDDINGS + "LayerNorm")
        for i, layer in enumerate(self.layers):
            p = _layer(i)
            attn, mlp = layer.attention, layer.mlp
            linear(attn.qkv_proj, [f"{p}attention.self.{n}" for n in QKV])
            linear(attn.o_proj, [p + "attention.output.dense"])
            norm(attn.norm, p + "attention.output.LayerNorm")
            linear(mlp.up_proj, [p + "intermediate.dense"])
            linear(mlp.down_proj, [p + "output.dense"])
            norm(mlp.norm, p + "output.LayerNorm")
        # (a GGUF's head may be out_proj alone: its converter drops the pooler that came before; gguf_fields below)
        heads = (tuple(n for n in CLASSIFIER if n + "weight" in weights) if CLASSIFIER[1] + "weight" in weights
                 else (POOLER, BERT_CLASSIFIER) if BERT_CLASSIFIER + "weight" in weights and POOLER + "weight" in weights
                 else ())
        if heads:
            self.classifier = [(loader.dense(get(n + "weight")).float(), loader.dense(get(n + "bias")).float())
                               for n in heads]
        if POOLER + "weight" in weights:
            self.pooler = RowInvariantLinear(self.config.hidden_size, self.config.hidden_size, True, self.ops)
            linear(self.pooler, [POOLER.rstrip(".")])

    def cache_specs(self) -> list[CacheSpec]:
        """K/V in the block pool for every layer, as the decoders (kept only for the forward that writes it)."""
        cfg = self.config
        return [KVSpec(cfg.num_key_value_heads, cfg.head_dim, 0) for _ in range(cfg.num_hidden_layers)]


def _placeholder(rows: int, hidden: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(rows, hidden, device="meta"), requires_grad=False)


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers' BertConfig / XLMRobertaConfig -> ModelConfig fields."""
    kind = raw.get("position_embedding_type") or "absolute"
    if kind != "absolute":
        raise NotImplementedError(f"position_embedding_type {kind!r}")
    if raw.get("is_decoder") or raw.get("add_cross_attention"):
        raise NotImplementedError("BERT as a decoder (is_decoder, add_cross_attention)")
    act = raw.get("hidden_act", "gelu")
    if act != "gelu":
        raise NotImplementedError(f"hidden_act {act!r}")
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    # XLM-R numbers positions from padding_idx + 1 (transformers' create_position_ids_from_input_ids)
    offset = int(raw.get("pad_token_id") or 0) + 1 if raw.get("model_type") == "xlm-roberta" else 0
    return dict(
        num_key_value_heads=heads, head_dim=hidden // heads, hidden_act="gelu", bidirectional=True, use_rope=False,
        attention_bias=True, attention_out_bias=True, mlp_bias=True, tie_word_embeddings=False,
        max_position_embeddings=int(raw.get("max_position_embeddings", 512)) - offset, position_offset=offset,
        type_vocab_size=int(raw.get("type_vocab_size", 2)), layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
    )


def weight_names(config: ModelConfig) -> list[str]:
    """What BertModel.load_weights reads, the word embeddings first (checkpoint.select_weights checks its shape)."""
    names = [EMBEDDINGS + "word_embeddings.weight", EMBEDDINGS + "position_embeddings.weight"]
    if config.type_vocab_size:
        names.append(EMBEDDINGS + "token_type_embeddings.weight")
    parts = [EMBEDDINGS + "LayerNorm"]
    for i in range(config.num_hidden_layers):
        p = _layer(i)
        parts += [f"{p}attention.self.{n}" for n in QKV]
        parts += [p + n for n in ("attention.output.dense", "attention.output.LayerNorm", "intermediate.dense",
                                  "output.dense", "output.LayerNorm")]
    return names + [f"{part}.{kind}" for part in parts for kind in ("weight", "bias")]


def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    """convert_hf_to_gguf's BertModel and its subclasses (DistilBERT: no token types; RoBERTa and XLM-RoBERTa: the
    position table already cut at the padding offset, so positions count from 0 here) as transformers' config.

    A classifier head makes the file a cross-encoder, run as the xlm-roberta family (which keeps that head), as is
    XLM-RoBERTa's `t5` vocabulary. RoBERTa's head is two layers (`cls`, `cls.output`); BERT's is the pooler's dense
    and `classifier`, but the converter drops the pooler and keeps `cls.output` alone, which is scored as llama.cpp
    scores it (see the warning). `cls` alone (the labels transformers makes up) is refused, as nothing in llama.cpp
    reads it as a score either."""
    if meta("attention.causal", False):
        raise ValueError("a causal bert model is not supported")
    head = {"cls.weight", "cls.output.weight"} & tensors.keys()
    if head == {"cls.weight"}:
        raise ValueError("a classifier head of cls alone (a cross-encoder converted with transformers' default "
                         "labels, its pooler dropped) is not supported; cls.output, with or without cls, is")
    if head == {"cls.output.weight"}:
        logger.warning("a BERT cross-encoder whose pooler the GGUF converter dropped: scored as llama.cpp scores it "
                       "(cls.output on the first token's hidden state, without the pooler's tanh(dense) before it), "
                       "so its scores differ from the original model's (the order mostly holds, the scale does not); "
                       "the Hugging Face directory scores as trained")
    types = tensors.get("token_types.weight")
    raw = dict(model_type="bert", hidden_size=base["hidden_size"], num_attention_heads=base["num_attention_heads"],
               max_position_embeddings=base["max_position_embeddings"],
               type_vocab_size=types[1] if types is not None else 0,  # GGUF shapes are reversed
               layer_norm_eps=float(meta("attention.layer_norm_epsilon", 1e-12)))
    roberta = meta("tokenizer.ggml.model") == "t5" or bool(head)
    return dict(hf_fields(raw), architecture="xlm-roberta" if roberta else "bert")


# llama.cpp's names for transformers' BertModel ones (without its `bert.` prefix): whole tensors and, per `blk.N.`,
# those of encoder.layer.N. The classifier head is `cls` (dense) then `cls.output` (out_proj).
GGUF_TENSORS = {"token_embd": "embeddings.word_embeddings", "token_types": "embeddings.token_type_embeddings",
                "position_embd": "embeddings.position_embeddings", "token_embd_norm": "embeddings.LayerNorm",
                "cls": "classifier.dense", "cls.output": "classifier.out_proj",
                "attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
                "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
                "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"}

register(Family("bert", "conveyor.models.bert:BertModel", hf_fields, weight_renames={"bert.": ""},
                weight_names=weight_names, optional_weights=(POOLER + "weight", POOLER + "bias",
                                                             BERT_CLASSIFIER + "weight", BERT_CLASSIFIER + "bias"),
                gguf_architectures=("bert",), gguf_fields=gguf_fields, gguf_tensors=GGUF_TENSORS,
                gguf_layer_prefix="encoder.layer."),
         Family("xlm-roberta", "conveyor.models.bert:BertModel", hf_fields, weight_renames={"roberta.": ""},
                weight_names=weight_names, optional_weights=(POOLER + "weight", POOLER + "bias", *(
                    part + kind for part in CLASSIFIER for kind in ("weight", "bias")))))
