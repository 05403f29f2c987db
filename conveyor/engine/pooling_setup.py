"""Whether an engine pools (embeddings, reranker scores) instead of generating, and how.

An embedding model says so itself (its sentence-transformers files or a GGUF's pooling_type, read by the
loader into Checkpoint.pooling; an encoder without an LM head always pools). A generating model pools only
when asked, as llama-server does: --embeddings (rows chosen by --pooling) or --reranking. A pooling engine
serves /v1/embeddings (or /v1/rerank) and refuses completions; a generating one refuses embeddings.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from conveyor.config import EngineConfig
from conveyor.loading.checkpoint import Checkpoint
from conveyor.models.config import ModelConfigError
from conveyor.models.pooling import PoolingConfig, PoolingConfigError


def resolve_pooling(config: EngineConfig, checkpoint: Checkpoint, model: nn.Module) -> PoolingConfig | None:
    """The engine's pooling, or None for a generating engine; ModelConfigError (refused at startup) where the
    flags ask for what the model cannot do."""
    pooling = checkpoint.pooling
    bidirectional = checkpoint.config.bidirectional
    # A cross-encoder (a checkpoint with a classifier head: XLMRobertaForSequenceClassification) reranks by itself.
    rerank = config.reranking or config.pooling == "rank" or getattr(model, "has_classifier", False)
    if pooling is None and (config.embeddings or rerank or bidirectional):
        # sentence-transformers pools a bare encoder by the mean; a decoder's vector is its last token's.
        pooling = PoolingConfig(pooling="mean" if bidirectional else "last")
    if pooling is None:
        return None
    if not callable(getattr(model, "hidden_states", None)):
        raise ModelConfigError(f"{checkpoint.config.architecture} models cannot pool (embeddings and reranking run "
                               f"on the dense decoder families and the encoders)")
    try:
        if config.pooling not in ("auto", "rank"):
            pooling = replace(pooling, pooling=config.pooling)
        if rerank:
            pooling = replace(pooling, normalize=False, dense=(), **_score(checkpoint, model))
    except PoolingConfigError as exc:
        raise ModelConfigError(str(exc)) from exc
    return pooling


def _score(checkpoint: Checkpoint, model: nn.Module) -> dict:
    """How a reranker scores: its classifier head, on the row its config pools (the first token's; ModernBERT's
    may be the mean), where the model has one, else the odds of "yes" over "no" (Qwen3-Reranker's reading)."""
    if getattr(model, "has_classifier", False):
        return dict(score="classifier", pooling=checkpoint.config.classifier_pooling)
    tokenizer = checkpoint.tokenizer
    yes, no = tokenizer.token_to_id("yes"), tokenizer.token_to_id("no")
    if yes is None or no is None or not callable(getattr(model, "compute_logits", None)):
        raise PoolingConfigError("this model has no classifier head and no 'yes' / 'no' tokens to score by")
    return dict(score="yes_no", yes_no_token_ids=(yes, no))


def pooling_weight_dtype(config: EngineConfig, checkpoint: Checkpoint, backend_name: str) -> str:
    """--weight-dtype for this engine. A pooling engine runs prefill only, where on AMX the bf16 tile GEMM
    outruns the int8 block kernels (a Qwen3-Embedding-0.6B-shaped Q8_0 file: 4.07 against 2.10 texts/s of 200
    tokens, benchmarks/results.md), so `auto` dequantizes GGUF blocks to bf16 there, at twice the weights' bytes."""
    pools = (checkpoint.pooling is not None or config.embeddings or config.reranking or config.pooling == "rank"
             or checkpoint.config.bidirectional)
    if config.weight_dtype == "auto" and pools and backend_name == "amx" and config.dtype in ("auto", "bfloat16"):
        return "bf16"
    return config.weight_dtype
