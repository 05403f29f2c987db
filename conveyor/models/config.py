"""Architecture description shared by the loaders and the model code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.models import mixtral, olmoe, qwen3_moe

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "olmoe")
# Per family: raw HF config -> the ModelConfig fields where it differs from Llama (each family's own file).
FAMILY_FIELDS = {"mixtral": mixtral.hf_fields, "qwen3_moe": qwen3_moe.hf_fields, "olmoe": olmoe.hf_fields}


class ModelConfigError(ValueError):
    """A model's config is missing, malformed or describes something we cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...} or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    qk_norm_scope: str = "head"  # q/k RMSNorm per head (Qwen3) or over the whole projection ("full": OLMoE)
    sliding_window: int | None = None  # Mistral: each token sees only the last N positions
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Mixture of experts (models/moe.py); num_experts == 0 is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one expert's MLP width
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    dense_mlp_layers: tuple[int, ...] = ()  # layers of an MoE model that keep a dense MLP (Qwen3-MoE)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"model config field {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                                   f"({self.num_experts})")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ModelConfigError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size!r}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` runs a sparse mixture-of-experts MLP."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config.json dict (Llama / Mistral / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE / OLMoE)."""
        model_type = raw.get("model_type")
        archs = raw.get("architectures") or []
        if model_type is None and archs:
            model_type = str(archs[0]).replace("ForCausalLM", "").lower()
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"unsupported model_type {model_type!r} (architectures={archs}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            # transformers >= 5 nests rope settings in rope_parameters; older files keep them top-level.
            rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
            rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            family = FAMILY_FIELDS[model_type](raw) if model_type in FAMILY_FIELDS else {}
            fields = dict(
                architecture=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
                rope_theta=rope_theta,
                rope_scaling=rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
                qk_norm=model_type == "qwen3",
                # Qwen2's per-layer windows (use_sliding_window) are not supported; it runs full attention.
                sliding_window=raw.get("sliding_window") if model_type == "mistral" else None,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
            return cls(**{**fields, **family})
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ModelConfigError):
                raise
            raise ModelConfigError(f"malformed model config: {exc!r}") from exc


@dataclass(frozen=True)
class ExpertNames:
    """Where a family's checkpoints keep the sparse MLP: `model.layers.N.{block}.gate.weight` (router) and
    `model.layers.N.{block}.experts.{e}.{gate|up|down}.weight`, as on the Hub (transformers 5 saves them so too).

    `prefix` is the layer's, with its dot: `model.layers.N.`."""

    block: str
    gate: str
    up: str
    down: str

    def router(self, prefix: str) -> str:
        return f"{prefix}{self.block}.gate.weight"

    def expert(self, prefix: str, expert: int, part: str) -> str:
        """`part`: gate, up or down."""
        return f"{prefix}{self.block}.experts.{expert}.{getattr(self, part)}.weight"


EXPERT_NAMES = {"mixtral": ExpertNames("block_sparse_moe", "w1", "w3", "w2"),
                "qwen3_moe": ExpertNames("mlp", "gate_proj", "up_proj", "down_proj"),
                "olmoe": ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")}

