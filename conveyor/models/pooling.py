"""Pooling models (embedders, rerankers): how a sequence's final hidden states become one vector or one score.

The runner hands each finished pooling sequence's rows here (runner/model_runner.py); this module knows
nothing of batches, so a text's vector depends on its own rows only: bitwise the same alone or in any batch.
What a checkpoint asks for comes from sentence-transformers' files (loading/sentence_transformers.py), a
GGUF's `{arch}.pooling_type`, or the `--pooling` flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

# Which rows make the vector: the last token (decoder embedders: Qwen3-Embedding), the mean of all tokens
# (most BERT-style sentence embedders), the first token (CLS: BGE).
POOLING_TYPES = ("last", "mean", "cls")
# How a reranker scores a (query, document) text: a classifier head on the pooled row (BERT-style
# cross-encoders: bge-reranker), or the next-token odds of "yes" against "no" (Qwen3-Reranker).
SCORE_KINDS = ("classifier", "yes_no")


class PoolingConfigError(ValueError):
    """A pooling setting a model cannot run with."""


@dataclass(frozen=True)
class DenseSpec:
    """A sentence-transformers Dense module after pooling: out = activation(W x + b)."""

    weight: torch.Tensor  # (out, in)
    bias: torch.Tensor | None
    activation: str = "identity"  # "identity" or "tanh"


@dataclass(frozen=True)
class PoolingConfig:
    pooling: str = "last"
    normalize: bool = True  # L2-normalised vectors (sentence-transformers' Normalize module)
    dense: tuple[DenseSpec, ...] = ()
    # Named prompts prepended to an input (sentence-transformers' `prompts`: Qwen3-Embedding's "query" instruction).
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    score: str | None = None  # None: an embedder; else one of SCORE_KINDS (a reranker)
    yes_no_token_ids: tuple[int, int] | None = None  # score "yes_no": the ("yes", "no") token ids

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise PoolingConfigError(f"unsupported pooling {self.pooling!r} (supported: {', '.join(POOLING_TYPES)})")
        if self.score is not None and self.score not in SCORE_KINDS:
            raise PoolingConfigError(f"unsupported score {self.score!r} (supported: {', '.join(SCORE_KINDS)})")
        if self.score == "yes_no" and self.yes_no_token_ids is None:
            raise PoolingConfigError("a yes/no reranker needs the ids of its 'yes' and 'no' tokens")

    @property
    def whole_sequence(self) -> bool:
        """Whether the vector needs every row of the sequence in one forward (mean, CLS); last-token pooling
        takes the last chunk's last row, so a long causal prompt may still be chunked."""
        return self.pooling != "last"

    @property
    def dimensions(self) -> int | None:
        """The vector's width after the dense layers (None: the model's hidden size)."""
        return int(self.dense[-1].weight.shape[0]) if self.dense else None


def pool_rows(rows: torch.Tensor, pooling: str) -> torch.Tensor:
    """rows (n, hidden): one sequence's final hidden states (every row for mean and CLS, the last row
    for last-token pooling) -> (hidden,) fp32. The rows are copied into a fresh tensor first, so the
    reduction never depends on where the sequence sat in the batch."""
    rows = rows.float().clone()
    if pooling == "mean":
        return rows.mean(dim=0)
    if pooling == "cls":
        return rows[0]
    return rows[-1]


class Pooler(nn.Module):
    """Pooled row -> the model's vector: the dense layers, then (if asked) L2 normalisation; in fp32."""

    def __init__(self, config: PoolingConfig) -> None:
        super().__init__()
        self.config = config
        self.dense = [(spec.weight.float(), None if spec.bias is None else spec.bias.float(), spec.activation)
                      for spec in config.dense]

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        x = pooled.float()
        for weight, bias, activation in self.dense:
            x = nn.functional.linear(x[None], weight, bias)[0]
            if activation == "tanh":
                x = torch.tanh(x)
        if self.config.normalize:
            x = nn.functional.normalize(x, dim=-1)
        return x
