"""Every flag of conveyor in one place: CLI option, CONVEYOR_* environment variable and config field.

`FLAGS` is the single source of truth. argparse parsers are generated from it, the
environment is read only here, and the result is frozen dataclasses validated on creation.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from conveyor.kernels.backend import KernelSettings


# --weight-dtype values (models/weights.py implements them).
WEIGHT_DTYPES = ("auto", "bf16", "int8", "q8_0", "q4_0")
# --cache-type-k / --cache-type-v values (kernels/kv_quant.py): bf16 = the activation dtype (--dtype), unquantized.
KV_CACHE_TYPES = ("bf16", "q8_0")


@dataclass(frozen=True)
class EngineConfig:
    # HF directory, .gguf file or Hugging Face Hub name ORG/NAME[:QUANT] (loading/hub.py); None = bundled SmolLM2
    model: str | None = None
    hf_file: str | None = None  # with a Hub name: this GGUF file of the repo (llama-server's --hf-file)
    revision: str | None = None  # with a Hub name: branch, tag or commit (None = the repo's default branch)
    dtype: str = "auto"  # auto = bfloat16 (CPU and CUDA); float32 / float16 / bfloat16
    device: str = "auto"  # auto = cuda when present, else mps (Apple GPU), else cpu
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    # auto: GGUF blocks (Q4_K, Q8_0, ...) stay quantized, float weights in dtype; bf16: dequantize GGUF blocks;
    # int8: weight-only int8 linears; q8_0 / q4_0: quantize float weights at load (see models/weights.py)
    weight_dtype: str = "auto"
    batch_invariant: bool = True  # row-tiled GEMMs so outputs never depend on batch-mates
    seed: int = 0  # seed of the shared RNG for unseeded sampling
    block_size: int = 16
    kv_cache_budget: str = "auto"  # auto | none | bytes (suffixes K/M/G accepted)
    cache_type_k: str = "bf16"  # K cache elements: bf16 (the activation dtype) or q8_0 (int8 + fp16 scale per 32)
    cache_type_v: str = "bf16"  # V cache elements, likewise
    enable_prefix_caching: bool = True
    # Requests with images use the prefix cache too (keys cover each image's content hash; docs/vision.md).
    vlm_prefix_cache: bool = True
    mmproj: str | None = None  # llama.cpp's vision projector GGUF for a GGUF text model (llama-server's --mmproj)
    prompt_cache_budget: str = "2G"  # cold cached prefixes kept (bytes, K/M/G); none = bounded by the pool only
    # The prefix cache's disk tier (engine/prefix_disk.py): evicted and shutdown blocks spill there, RAM misses
    # read back, and it survives restarts. None = RAM only.
    prompt_cache_dir: str | None = None
    prompt_cache_disk_budget: str = "8G"  # bytes of block files kept (K/M/G); none = unbounded
    # Bytes of the disk tier's most recently used blocks read into the RAM prefix cache at start (K/M/G; 0 = off).
    prompt_cache_preload: str = "1G"
    slot_save_path: str | None = None  # llama-server's slot persistence: where POST /slots/{id}?action=save writes
    # Hybrid models: recurrent-state snapshots kept at block boundaries of cached prompts (0: a hybrid's
    # prompts never hit the prefix cache, as its state can only resume where a snapshot was taken).
    state_snapshots: int = 8
    state_snapshot_interval: int = 1024  # hybrid prompts also snapshot every this many tokens (0 = off)
    parallel: int = 4  # request slots; -1 = auto (4 slots sharing one unified KV window)
    max_batch_size: int = 0  # 0 = same as parallel
    ctx_size: int = 0  # 0 = the model's context; explicit = total budget split across slots
    kv_unified: bool = False  # every slot may use the whole window (implied by --parallel -1)
    no_kv_unified: bool = False  # split windows even with --parallel -1
    max_kv_size: int = 0  # cap on KV tokens in the pool (and per slot); 0 = none
    no_batch: bool = False  # the sequential path: one request at a time, the whole context
    max_queue_depth: int = 32
    prefill_chunk_size: int = -1  # -1 = adaptive (2048 idle / 512 while decoding), 0 = no chunking
    prefill_grant_interval: int = 16
    max_batch_prefill: int = 4
    max_batch_prefill_tokens: int = -1  # -1 = derived 2 * max_batch_prefill * min(chunk, 512), 0 = no cap
    tick_policy: str = "alternate"  # measured better for live streams, see benchmarks/results.md
    enable_preemption: bool = False
    # One priority level per 10 s waited: a burst drains in seconds, so priority still orders it; only
    # sustained overload lets a low request through, after (priority gap) x 10 s. 0 = strict priority.
    priority_aging_s: float = 10.0
    preemption_policy: str = "longest-first"
    kv_admission_watermark: float = 0.01
    speculative_ngram: int = 4  # draft tokens per step by prompt lookup (greedy requests); 0 = off
    speculative_max_rows: int = 16  # decode rows + draft tokens of one tick; no drafts beyond
    draft_kind: str = "auto"  # auto | prompt-lookup | draft-model | mtp | eagle3 | dflash | none (seeds' spelling)
    decode_storage_backend: str = "auto"  # the seeds' flag: auto | paged, both our one paged pool
    prompt_lookup_max_batch: int = 0  # prompt-lookup drafts only while <= N rows decode; 0 = no limit
    draft_model: str | None = None  # HF directory or .gguf sharing the target's tokenizer
    draft_block_size: int = 4  # draft-model tokens proposed per row per step
    draft_policy: str = "adaptive"  # adaptive (measured per batch size) | enable | decline
    draft_vocab: str | None = None  # token-frequency file: the MTP / DFlash head scores only its top ids (FR-Spec)
    draft_vocab_size: int = 0  # ids of --draft-vocab kept (special tokens included); 0 = every id it lists
    draft_vocab_type: str = "same"  # the gathered rows' format: same (the head's own) | q8_0 | q4_0 (fewer bytes)
    draft_p_min: float = 0.0  # a greedy row stops drafting at a draft whose top probability is below this; 0 = off
    cache_dir: str | None = None  # persisted verdicts; None = $XDG_CACHE_HOME/conveyor or ~/.cache/conveyor
    kernel_arch: str = "native"  # -march of the C++ CPU kernels (x86-64, x86-64-v3, ...)
    require_kernels: bool = False  # fail at startup when a C++ kernel does not build (CI)
    disable_kernel: bool = False  # torch paths only (no C++ kernels: no batch invariance, no speculation)
    grammar_cache_size: int = 64  # compiled grammars (JSON schemas, tool sets) kept for reuse; 0 = no cache
    # Pooling (engine/pooling_setup.py): llama-server's --embeddings serves vectors from any model, --pooling picks
    # the rows (auto: the model's own, else last), --reranking serves scores. Embedding models pool without them.
    embeddings: bool = False
    pooling: str = "auto"
    reranking: bool = False

    def __post_init__(self) -> None:
        _require(self.dtype in ("auto", "bfloat16", "float32", "float16"), f"unknown dtype {self.dtype!r}")
        _require(self.weight_dtype in WEIGHT_DTYPES,
                 f"unknown weight_dtype {self.weight_dtype!r} (one of {', '.join(WEIGHT_DTYPES)})")
        _require(self.device in ("auto", "cpu", "cuda", "mps") or self.device.startswith("cuda:"),
                 f"unknown device {self.device!r}")
        _require(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
                 "block_size must be a power of two")
        _require(self.parallel >= 1 or self.parallel == -1, "parallel must be at least 1, or -1 (auto)")
        _require(self.max_kv_size >= 0, "max_kv_size must be >= 0")
        _require(not (self.kv_unified and self.no_kv_unified), "--kv-unified and --no-kv-unified contradict")
        parse_kv_budget(self.prompt_cache_budget)
        _require(parse_kv_budget(self.prompt_cache_disk_budget) != -1, "prompt_cache_disk_budget cannot be auto")
        parse_preload_bytes(self.prompt_cache_preload)
        _require(self.model is not None or (self.hf_file is None and self.revision is None),
                 "--hf-file and --revision need a Hugging Face Hub name: --model ORG/NAME")
        _require(self.draft_kind in DRAFT_KINDS, f"draft_kind must be one of {', '.join(DRAFT_KINDS)}")
        _require(self.decode_storage_backend in DECODE_STORAGE_BACKENDS,
                 f"decode_storage_backend must be one of {', '.join(DECODE_STORAGE_BACKENDS)}")
        _require(self.draft_kind != "draft-model" or self.draft_model is not None,
                 "--draft-kind draft-model needs --draft-model PATH")
        _require(self.draft_kind != "mtp" or self.draft_model is None,
                 "--draft-kind mtp drafts with the model's own MTP head; --draft-model is for --draft-kind draft-model")
        _require(self.draft_kind != "eagle3" or self.draft_model is not None,
                 "--draft-kind eagle3 needs --draft-model PATH (the EAGLE3 drafter's Hugging Face directory)")
        _require(self.draft_kind != "dflash" or self.draft_model is not None,
                 "--draft-kind dflash needs --draft-model PATH (the DFlash drafter's Hugging Face directory)")
        _require(1 <= self.draft_block_size <= 16, "draft_block_size must be in [1, 16]")
        _require(self.prompt_lookup_max_batch >= 0, "prompt_lookup_max_batch must be >= 0")
        _require(self.draft_policy in ("adaptive", "enable", "decline"),
                 "draft_policy must be adaptive, enable or decline")
        _require(self.draft_vocab_size >= 0, "draft_vocab_size must be >= 0 (0 = every id --draft-vocab lists)")
        _require(self.draft_vocab is not None or self.draft_vocab_size == 0,
                 "--draft-vocab-size needs --draft-vocab FILE (the token frequencies that rank the ids)")
        _require(0.0 <= self.draft_p_min < 1.0, "draft_p_min must be in [0, 1) (0 = off)")
        _require(self.draft_vocab_type in DRAFT_VOCAB_TYPES,
                 f"draft_vocab_type must be one of {', '.join(DRAFT_VOCAB_TYPES)}")
        _require(self.draft_vocab is not None or self.draft_vocab_type == "same",
                 "--draft-vocab-type needs --draft-vocab FILE (it sets the format of the rows gathered from it)")
        _require(self.draft_vocab is None or self.draft_kind in ("mtp", "dflash"),
                 "--draft-vocab applies to --draft-kind mtp or dflash (the drafters that score with the target's "
                 "LM head; an EAGLE3 drafter carries its own draft vocabulary, d2t)")
        _require(self.max_batch_size >= 0, "max_batch_size must be >= 0")
        _require(self.ctx_size >= 0, "ctx_size must be >= 0")
        _require(self.max_queue_depth >= 1, "max_queue_depth must be at least 1")
        _require(self.prefill_chunk_size >= -1, "prefill_chunk_size must be -1 (adaptive), 0 or positive")
        parse_kv_budget(self.kv_cache_budget)
        for name in ("cache_type_k", "cache_type_v"):
            value = getattr(self, name)
            _require(value in KV_CACHE_TYPES,
                     _KV_CACHE_TYPE_REFUSALS.get(value, f"unknown {name} {value!r}") + f" (supported: {_KV_TYPES_TEXT})")
        _require(self.tick_policy in ("mixed", "alternate"), "tick_policy must be mixed or alternate")
        _require(self.preemption_policy in ("longest-first", "lowest-priority"),
                 "preemption_policy must be longest-first or lowest-priority")
        _require(self.priority_aging_s >= 0, "priority_aging_s must be >= 0 (0 = no aging)")
        _require(0.0 <= self.kv_admission_watermark <= 0.5, "kv_admission_watermark must be in [0.0, 0.5]")
        _require(self.prefill_grant_interval >= 0, "prefill_grant_interval must be >= 0")
        _require(0 <= self.speculative_ngram <= 16, "speculative_ngram must be in [0, 16]")
        _require(self.speculative_max_rows >= 1, "speculative_max_rows must be at least 1")
        _require(self.state_snapshots >= 0, "state_snapshots must be >= 0")
        _require(self.state_snapshot_interval >= 0, "state_snapshot_interval must be >= 0")
        _require(self.max_batch_prefill >= 1, "max_batch_prefill must be at least 1")
        _require(self.max_batch_prefill_tokens >= -1, "max_batch_prefill_tokens must be -1, 0 or positive")
        _require(self.grammar_cache_size >= 0, "grammar_cache_size must be >= 0")
        _require(self.pooling in POOLING_FLAG_VALUES, f"pooling must be one of {', '.join(POOLING_FLAG_VALUES)}")
        _require(bool(self.kernel_arch.strip()) and self.kernel_arch.strip() == self.kernel_arch
                 and not self.kernel_arch.startswith("-"), f"bad kernel_arch {self.kernel_arch!r}")

    @property
    def kernel_settings(self) -> "KernelSettings":
        from conveyor.kernels.backend import KernelSettings

        return KernelSettings(arch=self.kernel_arch, require=self.require_kernels, disable=self.disable_kernel)

    @property
    def num_slots(self) -> int:
        if self.no_batch:
            return 1
        return AUTO_PARALLEL_SLOTS if self.parallel == -1 else self.parallel

    @property
    def effective_max_batch_size(self) -> int:
        return 1 if self.no_batch else (self.max_batch_size or self.num_slots)

    @property
    def effective_kv_unified(self) -> bool:
        """--kv-unified, or --parallel -1 unless --no-kv-unified (llama.cpp's unified default for auto slots)."""
        if self.no_kv_unified or self.no_batch:
            return False
        return self.kv_unified or self.parallel == -1

    @property
    def kv_quantized(self) -> bool:
        return "q8_0" in (self.cache_type_k, self.cache_type_v)

    @property
    def ngram_enabled(self) -> bool:
        return self.draft_kind in ("auto", "prompt-lookup") and self.speculative_ngram > 0

    @property
    def draft_model_enabled(self) -> bool:
        return self.draft_kind in ("auto", "draft-model") and self.draft_model is not None


HOSTED_TOOLS = ("refuse", "ignore")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    metrics: bool = False
    webui: bool = True  # the chat + live dashboard page at / (server/webui.py, static/)
    served_model_name: str | None = None
    # With one model served, a request's `model` may name anything (llama-server's and the seeds' behaviour:
    # agents send their own default names); strict answers 404 unless it is the served or checkpoint name.
    strict_model_name: bool = False
    shutdown_grace_seconds: float = 30.0
    # Request limits (server/limits.py): refused with 413 / 400 before anything is tokenized.
    max_request_bytes: int = 8 << 20
    max_json_depth: int = 64
    max_messages: int = 2048
    max_prompt_chars: int = 1_000_000
    max_n: int = 16
    max_stop_strings: int = 16
    max_logit_bias: int = 300
    # |priority| bound (body field or X-Priority): aging bounds a queued request's wait at (priority gap) x
    # --priority-aging-s, so an unbounded priority would let one client hold everyone else back indefinitely.
    max_priority: int = 100
    reasoning_parser: str = "auto"  # <think>...</think> -> reasoning_content: auto (if the template has it) | think | none
    chat_template_kwargs: str | None = None  # JSON object: extra chat-template variables for every request
    # The Responses API's store (server/apis/response_store.py): the oldest are dropped past either bound.
    responses_store_max: int = 1000
    responses_store_max_bytes: int = 64 << 20
    # Hosted tools (web_search, code execution...) offered in /v1/responses or /v1/messages: refuse (a 400 naming
    # them) or ignore (left out of the prompt: the model cannot call them, as nothing here could run them).
    hosted_tools: str = "refuse"
    # Images in requests (multimodal/image_fetch.py): data: URLs always; http(s) and file:// only where allowed.
    max_images: int = 8
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 40_000_000
    image_fetch_timeout: float = 10.0
    allow_remote_images: bool = False
    allowed_media_domains: str | None = None  # comma-separated host names
    allowed_local_media_path: str | None = None

    def __post_init__(self) -> None:
        _require(self.reasoning_parser in ("auto", "think", "none"), "reasoning_parser must be auto, think or none")
        _require(self.hosted_tools in HOSTED_TOOLS, f"hosted_tools must be one of {', '.join(HOSTED_TOOLS)}")
        self.template_kwargs  # a bad --chat-template-kwargs fails at startup, not on the first request
        for name in ("max_request_bytes", "max_json_depth", "max_messages", "max_prompt_chars", "max_n",
                     "max_stop_strings", "max_logit_bias", "responses_store_max", "responses_store_max_bytes",
                     "max_image_bytes", "max_image_pixels"):
            _require(getattr(self, name) >= 1, f"{name} must be at least 1")
        _require(self.max_images >= 0, "max_images must be >= 0")
        _require(self.image_fetch_timeout > 0, "image_fetch_timeout must be > 0")
        _require(self.max_priority >= 0, "max_priority must be >= 0")

    @property
    def template_kwargs(self) -> dict[str, Any]:
        if not self.chat_template_kwargs:
            return {}
        try:
            value = json.loads(self.chat_template_kwargs)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"chat_template_kwargs must be a JSON object: {exc}") from None
        _require(isinstance(value, dict), "chat_template_kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
        from conveyor.loading.chat_template import RESERVED_TEMPLATE_VARIABLES

        reserved = sorted(RESERVED_TEMPLATE_VARIABLES & value.keys())
        _require(not reserved, f"chat_template_kwargs cannot set {', '.join(reserved)} (conveyor fills them)")
        return value


# What a request for a model that does not fit does while every loaded model is busy (the seeds' vllm-mlx
# registry policies; server/multimodel/registry.py).
CONTENTION_POLICIES = ("fail", "wait", "preempt", "wait_then_fail", "wait_then_preempt")


@dataclass(frozen=True)
class ModelsConfig:
    """Several models in one server (server/multimodel/): where they come from and the memory they share."""

    models: tuple[str, ...] = ()  # --model given more than once: each one a model source
    models_dir: str | None = None  # every GGUF file and model directory in it
    models_preset: str | None = None  # an INI file: [name] sections with a source and that model's own flags
    # Bytes (K/M/G) the loaded models may take together (weights + KV pool + recurrent state); none = no cap.
    models_memory_budget: str = "none"
    models_max: int = 4  # most models loaded at once (llama-server's default)
    models_autoload: bool = True  # load a model on its first request (off: only POST /models/load and pins)
    models_contention: str = "wait_then_fail"  # when a load does not fit and no loaded model is idle
    models_wait_timeout: float = 60.0  # seconds a request waits under wait_then_fail before its 503
    # The cores' share embedding and reranking models get while generating models stream (1: no turns).
    models_background_share: float = 0.33
    # The share of time a model's load works while other models stream (it rests the rest: less memory traffic).
    models_load_duty: float = 0.5

    def __post_init__(self) -> None:
        _require(self.models_max >= 1, "models_max must be at least 1")
        _require(self.models_contention in CONTENTION_POLICIES,
                 f"models_contention must be one of {', '.join(CONTENTION_POLICIES)}")
        _require(self.models_wait_timeout > 0, "models_wait_timeout must be positive")
        _require(0 < self.models_background_share <= 1, "models_background_share must be in (0, 1]")
        _require(0 < self.models_load_duty <= 1, "models_load_duty must be in (0, 1]")
        self.memory_budget_bytes  # a bad budget fails at startup

    @property
    def enabled(self) -> bool:
        """Serving several models: --model given twice or more, --models-dir or --models-preset."""
        return len(self.models) > 1 or self.models_dir is not None or self.models_preset is not None

    @property
    def memory_budget_bytes(self) -> int | None:
        text = str(self.models_memory_budget).strip().lower()
        try:
            _require(text != "auto", "auto is not a budget here")
            return parse_kv_budget(text)
        except ConfigError:
            raise ConfigError(f"models_memory_budget must be none or a byte count such as 8G, got "
                              f"{self.models_memory_budget!r}") from None


NODE_ROLES = ("prefill", "decode", "router")


@dataclass(frozen=True)
class ClusterConfig:
    """Disaggregated serving (docs/distributed.md). node_role None = today's single node, untouched."""

    node_role: str | None = None
    serving_bind: str | None = None  # host:port of this node's role transport
    decode_peers: str | None = None  # comma-separated host:port
    prefill_peers: str | None = None
    decode_allowlist: str | None = None  # numeric IP:port list a prefill node checks decode_target against
    health_check_interval: float = 1.0  # seconds between the router's TCP probes of every peer

    def __post_init__(self) -> None:
        _require(self.node_role is None or self.node_role in NODE_ROLES,
                 f"node_role must be one of {', '.join(NODE_ROLES)}")
        _require(self.health_check_interval > 0, "health_check_interval must be positive")
        if self.node_role is None:
            return
        if self.node_role != "router":  # a router only dials out; its HTTP front is --host/--port
            _require(self.serving_bind is not None, f"--node-role {self.node_role} needs --serving-bind host:port")
        else:
            _require(bool(self.prefill_peer_list) and bool(self.decode_peer_list),
                     "--node-role router needs --prefill-peers and --decode-peers")

    @property
    def decode_peer_list(self) -> list[str]:
        return _split_peers(self.decode_peers)

    @property
    def prefill_peer_list(self) -> list[str]:
        return _split_peers(self.prefill_peers)


def _split_peers(text: str | None) -> list[str]:
    return [p.strip() for p in (text or "").split(",") if p.strip()]


AUTO_PARALLEL_SLOTS = 4  # --parallel -1: llama.cpp's auto slot count
DRAFT_KINDS = ("auto", "prompt-lookup", "draft-model", "mtp", "eagle3", "dflash", "none")
# --pooling values, llama-server's: rank = a reranker's score (as --reranking).
POOLING_FLAG_VALUES = ("auto", "last", "mean", "cls", "rank")
DECODE_STORAGE_BACKENDS = ("auto", "paged")  # conveyor's KV is always one paged block pool
DRAFT_VOCAB_TYPES = ("same", "q8_0", "q4_0")  # --draft-vocab-type: the drafter's gathered head rows

_KV_TYPES_TEXT = ", ".join(KV_CACHE_TYPES)
# llama-server cache types conveyor does not offer, with why.
_KV_CACHE_TYPE_REFUSALS = {
    "f16": "f16 KV is not offered: the attention kernel reads an unquantized cache in the activation dtype (bf16), "
           "so f16 would cost a conversion per element and save no bytes over bf16",
    "f32": "f32 KV is not offered (use --dtype float32 with bf16, which keeps the cache in the activation dtype)",
}
for _name in ("q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"):
    _KV_CACHE_TYPE_REFUSALS[_name] = f"{_name} KV is not offered: conveyor's kernels read q8_0 blocks only"

# Seed values that name a feature conveyor does not have: refused with what to use instead.
REFUSED_VALUES: dict[tuple[str, str], str] = {
    **{(dest, value): f"{why} (supported: {_KV_TYPES_TEXT})" for dest in ("cache_type_k", "cache_type_v")
       for value, why in _KV_CACHE_TYPE_REFUSALS.items()},
    ("decode_storage_backend", "dense"): (
        "conveyor's KV is always paged (auto and paged are accepted); for the "
        "seeds' single-request reproduction path use --no-batch or --max-batch-size 1, and --no-prompt-cache "
        "(greedy output is batch-invariant by default)"),
}


class ConfigError(ValueError):
    pass


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def parse_kv_budget(value: str) -> int | None:
    """'auto' -> -1, 'none'/'0' -> None (unbounded), '2G' / '1500000' -> bytes."""
    text = str(value).strip().lower()
    if text == "auto":
        return -1
    if text in ("none", "0"):
        return None
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1:], 1)
    try:
        number = float(text[:-1] if scale > 1 else text)
    except ValueError:
        raise ConfigError(f"kv_cache_budget must be auto, none or a byte count, got {value!r}") from None
    _require(number > 0, "kv_cache_budget must be positive")
    return int(number * scale)


def parse_preload_bytes(value: str) -> int:
    """--prompt-cache-preload: '0' / 'off' / 'none' -> 0, else a byte count as parse_kv_budget reads one."""
    if str(value).strip().lower() in ("0", "off", "none"):
        return 0
    number = parse_kv_budget(value)
    _require(number is not None and number > 0, f"prompt_cache_preload must be a byte count or 0, got {value!r}")
    return number


def _bool(text: str) -> bool:
    if str(text).lower() in ("1", "true", "yes", "on"):
        return True
    if str(text).lower() in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"expected a boolean, got {text!r}")


parse_bool = _bool  # for config files read elsewhere (server/multimodel/catalog.py's presets)


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # first is canonical, e.g. ("--parallel", "--n-parallel", "-np")
    dest: str  # field of EngineConfig or ServerConfig
    type: Callable[[str], Any] = str
    help: str = ""
    switch: bool = False  # store_true style; `negate` flips the stored value
    negate: bool = False
    choices: tuple[str, ...] | None = None
    extra_env: tuple[str, ...] = ()
    repeat: bool = False  # may be given several times (a list on the command line; the env holds one value)

    @property
    def env(self) -> str:
        """Named after the field, so it holds the field's value: `--no-prompt-cache` is CONVEYOR_ENABLE_PREFIX_CACHING=0."""
        return "CONVEYOR_" + self.dest.upper()

    def refusal(self, text: str) -> str | None:
        """The message for a seed value conveyor does not offer (None when `text` is not one)."""
        return REFUSED_VALUES.get((self.dest, str(text).strip().lower()))

    @property
    def env_hint(self) -> str:
        """How --help names the variable: a switch shows the value that means the same as giving it."""
        return f"{self.env}={0 if self.negate else 1}" if self.switch else self.env


FLAGS: list[Flag] = [
    # --hf-repo/-hf are llama-server's spelling for a Hub name, so one field (and one env var) holds either.
    Flag(("--model", "-m", "--hf-repo", "-hf"), "model", repeat=True,
         help="HF model directory, .gguf file, or Hugging Face Hub name ORG/NAME[:QUANT] "
              "(none = the bundled SmolLM2-135M-Instruct); given several times, each is served by its name"),
    Flag(("--hf-file",), "hf_file", help="with a Hub name: the GGUF file of the repo to load"),
    Flag(("--revision",), "revision", help="with a Hub name: branch, tag or commit to download (none = default branch)"),
    Flag(("--dtype",), "dtype", choices=("auto", "bfloat16", "float32", "float16"), help="weights/activations dtype"),
    Flag(("--device",), "device", help="auto (cuda, else mps, else cpu), cpu, cuda[:N] or mps"),
    Flag(("--weight-dtype",), "weight_dtype", choices=WEIGHT_DTYPES,
         help="auto: GGUF quantized tensors stay quantized (Q4_K, Q8_0, ...), others in --dtype; bf16: dequantize "
              "them; int8: weight-only int8 linears; q8_0 / q4_0: quantize float checkpoints at load (CPU)"),
    Flag(("--threads", "-t"), "threads", int, "torch intra-op threads (0 = default)"),
    Flag(("--no-batch-invariant",), "batch_invariant", switch=True, negate=True,
         help="use whole-batch GEMMs: faster prefill, but outputs may depend on batch-mates"),
    Flag(("--seed",), "seed", int, "seed for unseeded sampling"),
    Flag(("--block-size",), "block_size", int, "tokens per KV block"),
    Flag(("--kv-cache-budget",), "kv_cache_budget", help="KV pool cap: auto, none, or bytes (e.g. 2G)"),
    Flag(("--cache-type-k", "-ctk"), "cache_type_k", choices=KV_CACHE_TYPES,
         help=f"K cache type ({_KV_TYPES_TEXT}): q8_0 keeps int8 + an fp16 scale per 32 values, ~0.53x the bytes "
              "(CPU; head_dim a multiple of 32)", extra_env=("LLAMA_ARG_CACHE_TYPE_K",)),
    Flag(("--cache-type-v", "-ctv"), "cache_type_v", choices=KV_CACHE_TYPES, help=f"V cache type ({_KV_TYPES_TEXT}), as --cache-type-k",
         extra_env=("LLAMA_ARG_CACHE_TYPE_V",)),
    Flag(("--no-prompt-cache",), "enable_prefix_caching", switch=True, negate=True, help="disable prefix caching"),
    Flag(("--apc-enabled",), "enable_prefix_caching", _bool, "automatic prefix caching on/off (=false: --no-prompt-cache)"),
    Flag(("--enable-vlm-prefix-cache",), "vlm_prefix_cache", switch=True,
         help="image requests use the prefix cache (keys cover the image's content hash)"),
    Flag(("--no-vlm-prefix-cache",), "vlm_prefix_cache", switch=True, negate=True,
         help="image requests skip the prefix cache"),
    Flag(("--mmproj", "-mm"), "mmproj",
         help="vision projector GGUF (llama.cpp's mmproj file) for a GGUF text model: the model takes images"),
    Flag(("--state-snapshots",), "state_snapshots", int,
         "hybrid models: recurrent-state snapshots kept for prefix-cache hits (each costs one sequence's state; 0 = none)"),
    Flag(("--state-snapshot-interval",), "state_snapshot_interval", int,
         "hybrid models: a prompt's prefill also snapshots the state every this many tokens (whole blocks), so "
         "prompts sharing a long prefix (a system prompt, tools) resume near its end; 0 = only where a prompt's "
         "last whole block ends and where a cached prefix matched"),
    Flag(("--prompt-cache-budget",), "prompt_cache_budget",
         help="bytes of cold cached prefixes kept for reuse (K/M/G), none = only the KV pool bounds them"),
    Flag(("--prompt-cache-dir",), "prompt_cache_dir",
         help="directory of the prefix cache's disk tier: evicted and shutdown blocks are written there and read "
              "back on a RAM miss, also after a restart (with sliding blocks and state snapshots; none = RAM only)"),
    Flag(("--prompt-cache-disk-budget",), "prompt_cache_disk_budget",
         help="bytes of block files the disk tier keeps (K/M/G), least recently used out first; none = no cap"),
    Flag(("--prompt-cache-preload",), "prompt_cache_preload",
         help="bytes of the disk tier's most recently used blocks read into the RAM prefix cache at start, so a "
              "restart's first requests hit RAM (K/M/G; 0 = off; bounded by the pool and --prompt-cache-budget)"),
    Flag(("--slot-save-path",), "slot_save_path",
         help="llama-server's slot persistence: POST /slots/{id}?action=save|restore|erase keep slot files here"),
    Flag(("--parallel", "--n-parallel", "-np"), "parallel", int, "request slots (-1 auto: 4 slots, unified KV)",
         extra_env=("LLAMA_ARG_N_PARALLEL",)),
    Flag(("--max-batch-size",), "max_batch_size", int, "max sequences decoded together (0 = --parallel)"),
    Flag(("--ctx-size", "-c"), "ctx_size", int, "total context budget split across slots (0 = model default)"),
    Flag(("--kv-unified",), "kv_unified", switch=True,
         help="every slot may use the whole --ctx-size window (default: only with --parallel -1)"),
    Flag(("--no-kv-unified",), "no_kv_unified", switch=True, help="split --ctx-size across the slots, also with --parallel -1"),
    Flag(("--max-kv-size",), "max_kv_size", int, "cap on KV tokens in the pool and per slot (0 = none)"),
    Flag(("--no-batch",), "no_batch", switch=True,
         help="serve one request at a time with the whole context (same engine at batch size 1)"),
    Flag(("--max-queue-depth",), "max_queue_depth", int, "max queued requests before HTTP 503"),
    Flag(("--prefill-chunk-size", "-b", "--batch-size"), "prefill_chunk_size", int,
         "prompt tokens per prefill chunk (-1 adaptive, 0 off)", extra_env=("LLAMA_ARG_BATCH",)),
    Flag(("--prefill-grant-interval",), "prefill_grant_interval", int,
         "alternate policy: decode ticks before a parked prefill is granted one (0 = unbounded wait)"),
    Flag(("--max-batch-prefill",), "max_batch_prefill", int, "queued prompts prefilled in one forward"),
    Flag(("--max-batch-prefill-tokens",), "max_batch_prefill_tokens", int,
         "token cap of one batched prefill (-1 derived = 2 * max_batch_prefill * min(chunk, 512), 0 = no cap)"),
    Flag(("--tick-policy",), "tick_policy", choices=("mixed", "alternate"),
         help="alternate (default): decode or prefill per tick; mixed: decode + prefill in one forward"),
    Flag(("--enable-preemption",), "enable_preemption", switch=True,
         help="let a higher-priority arrival evict a running lower-priority sequence"),
    Flag(("--priority-aging-s",), "priority_aging_s", float,
         "seconds of waiting worth one priority level, so higher-priority traffic delays a queued request "
         "by at most (priority gap) x this (0 = strict priority, no aging)"),
    Flag(("--preemption-policy",), "preemption_policy", choices=("longest-first", "lowest-priority"),
         help="victim selection for --enable-preemption"),
    Flag(("--kv-admission-watermark",), "kv_admission_watermark", float,
         "fraction of the KV budget kept free at admission while rows decode (0.0-0.5)"),
    Flag(("--speculative-ngram",), "speculative_ngram", int,
         "speculative decoding by prompt lookup: draft up to N tokens per step for greedy requests (0 = off)"),
    Flag(("--speculative-max-rows",), "speculative_max_rows", int,
         "cap on decode rows + draft tokens in one tick (drafts are free only while the step is bandwidth-bound)"),
    # --spec-type: llama-server's spelling (its `mtp` and `none` mean ours)
    Flag(("--draft-kind", "--spec-type"), "draft_kind", choices=DRAFT_KINDS,
         help="proposer: auto (draft model if given, prompt lookup per row), prompt-lookup, draft-model, "
              "mtp (the model's own multi-token-prediction head: Qwen3.5 / Qwen3-Next), eagle3 (the EAGLE3 drafter "
              "at --draft-model, reading three of the target's hidden states: Llama-family / Qwen3 targets), "
              "dflash (the DFlash block drafter at --draft-model: a block of drafts in one forward, same targets), "
              "none"),
    Flag(("--decode-storage-backend",), "decode_storage_backend", choices=DECODE_STORAGE_BACKENDS,
         help="the seeds' KV storage choice: auto and paged are both conveyor's one paged block pool (dense is refused)"),
    Flag(("--prompt-lookup-max-batch",), "prompt_lookup_max_batch", int,
         "prompt-lookup drafts only while at most N rows decode (0 = no limit)"),
    Flag(("--draft-model", "--model-draft"), "draft_model",
         help="draft model (HF directory or .gguf with the target's tokenizer) for speculative decoding; "
              "with --draft-kind eagle3 / dflash the EAGLE3 / DFlash drafter's HF directory"),
    Flag(("--draft-block-size",), "draft_block_size", int, "draft-model tokens proposed per row per step"),
    Flag(("--draft-policy",), "draft_policy", choices=("adaptive", "enable", "decline"),
         help="draft-model speculation: adaptive (measured per batch size, persisted), enable, decline"),
    Flag(("--draft-vocab",), "draft_vocab",
         help="token-frequency file (`TOKEN_ID COUNT` lines) for --draft-kind mtp / dflash: the drafter's LM head "
              "scores only the most frequent ids (plus special tokens), gathered once at load (FR-Spec); output is "
              "unchanged, drafts outside it are never proposed; none = the whole vocabulary"),
    Flag(("--draft-vocab-size",), "draft_vocab_size", int,
         "ids of --draft-vocab the drafter scores, special tokens included (0 = every id the file lists)"),
    Flag(("--draft-vocab-type",), "draft_vocab_type", choices=DRAFT_VOCAB_TYPES,
         help="format of --draft-vocab's gathered head rows: same (the head's own), q8_0 or q4_0 (requantized once "
              "at load: fewer bytes read per draft; drafts only, output unchanged)"),
    Flag(("--draft-p-min",), "draft_p_min", float,
         "model drafters (draft model, mtp, eagle3, dflash): a greedy row stops drafting at a draft whose top "
         "probability (over --draft-vocab's ids, when given) is below P (llama-server's --draft-p-min; 0 = off)"),
    Flag(("--cache-dir",), "cache_dir", help="where measured verdicts persist (default ~/.cache/conveyor)"),
    Flag(("--kernel-arch",), "kernel_arch",
         help="-march the C++ CPU kernels are built for (native, x86-64-v3, x86-64, ...); cached per value and CPU"),
    Flag(("--require-kernels",), "require_kernels", switch=True,
         help="refuse to start when a C++ kernel does not build (instead of the slower torch paths)"),
    Flag(("--disable-kernel",), "disable_kernel", switch=True,
         help="run the torch paths only (no batch invariance, no speculation; for debugging)"),
    Flag(("--embeddings", "--embedding"), "embeddings", switch=True, extra_env=("LLAMA_ARG_EMBEDDINGS",),
         help="serve /v1/embeddings from this model (embedding models need no flag): a generating model's vectors are "
              "pooled per --pooling, and it no longer serves completions"),
    Flag(("--pooling",), "pooling", choices=POOLING_FLAG_VALUES, extra_env=("LLAMA_ARG_POOLING",),
         help="which tokens make an embedding: last, mean, cls, or rank (a reranker's score); auto = the model's own "
              "(sentence-transformers files, GGUF pooling_type), else last"),
    Flag(("--reranking", "--rerank"), "reranking", switch=True, extra_env=("LLAMA_ARG_RERANKING",),
         help="serve /v1/rerank and /v1/score from this model: a cross-encoder's classifier, or a Qwen3-Reranker-style "
              "model's yes/no odds"),
    Flag(("--grammar-cache-size",), "grammar_cache_size", int,
         "compiled grammars (response_format schemas, tool sets) kept for reuse (0 = compile every time)"),
    Flag(("--reasoning-parser",), "reasoning_parser", choices=("auto", "think", "none"),
         help="<think>...</think> output to reasoning_content: auto (when the chat template uses <think>), think, none"),
    Flag(("--chat-template-kwargs",), "chat_template_kwargs",
         help="JSON object of extra chat-template variables for every request, e.g. '{\"enable_thinking\": false}' "
              "(a request's chat_template_kwargs override them)"),
    Flag(("--host",), "host", help="bind address"),
    Flag(("--port",), "port", int, "listen port"),
    Flag(("--api-key",), "api_key", help="require this bearer token on every route but /health and /metrics"),
    Flag(("--metrics",), "metrics", switch=True, help="expose Prometheus /metrics"),
    Flag(("--no-webui",), "webui", switch=True, negate=True, help="do not serve the chat and dashboard page at /"),
    Flag(("--served-model-name", "--alias"), "served_model_name", help="model id reported by /v1/models"),
    Flag(("--strict-model-name",), "strict_model_name", switch=True,
         help="404 for a request whose model names neither the served nor the checkpoint name (default: the one "
              "model served answers any name, as llama-server does)"),
    Flag(("--shutdown-grace-seconds",), "shutdown_grace_seconds", float, "in-flight grace period on SIGTERM"),
    Flag(("--max-request-bytes",), "max_request_bytes", int, "largest request body in bytes (HTTP 413 beyond)"),
    Flag(("--max-json-depth",), "max_json_depth", int, "deepest nesting of arrays/objects in a request body"),
    Flag(("--max-messages",), "max_messages", int, "most chat messages in one request"),
    Flag(("--max-prompt-chars",), "max_prompt_chars", int,
         "most prompt characters (or prompt token ids) in one request, checked before tokenization"),
    Flag(("--max-n",), "max_n", int, "most choices (n) per request"),
    Flag(("--max-stop-strings",), "max_stop_strings", int, "most stop strings, and most stop_token_ids, per request"),
    Flag(("--max-logit-bias",), "max_logit_bias", int, "most logit_bias entries per request"),
    Flag(("--max-priority",), "max_priority", int,
         "largest |priority| a request may ask for (body or X-Priority; 400 beyond), which bounds how long "
         "aging lets higher-priority traffic delay a queued request"),
    Flag(("--responses-store-max",), "responses_store_max", int,
         "most responses /v1/responses keeps for previous_response_id and GET (the oldest dropped)"),
    Flag(("--responses-store-max-bytes",), "responses_store_max_bytes", int,
         "most bytes of stored responses and their conversations (the oldest dropped)"),
    Flag(("--hosted-tools",), "hosted_tools", choices=HOSTED_TOOLS,
         help="provider-hosted tools a client offers (web_search, code execution...; Codex offers web_search): "
              "refuse with a 400 naming them, or ignore them (the model is not shown them)"),
    Flag(("--max-images",), "max_images", int,
         "most images in one request, all turns together (0 = refuse images)"),
    Flag(("--max-image-bytes",), "max_image_bytes", int, "largest image in bytes (encoded: after base64, or as fetched)"),
    Flag(("--max-image-pixels",), "max_image_pixels", int,
         "largest image in pixels (width x height), checked from the header before decoding"),
    Flag(("--image-fetch-timeout",), "image_fetch_timeout", float, "seconds an http(s) image URL may take to fetch"),
    Flag(("--allow-remote-images",), "allow_remote_images", switch=True,
         help="fetch http(s) image URLs from any host (off: data: URLs only; the server makes the request, so "
              "only on a trusted network)"),
    Flag(("--allowed-media-domains",), "allowed_media_domains",
         help="fetch http(s) image URLs from these hosts only (comma-separated exact host names)"),
    Flag(("--allowed-local-media-path",), "allowed_local_media_path",
         help="serve file:// image URLs from under this directory (symlinks resolved; none = refused)"),
    Flag(("--models-dir",), "models_dir",
         help="serve every GGUF file and model directory in DIR, each named as its file (without .gguf) or directory"),
    Flag(("--models-preset",), "models_preset",
         help="INI file of models: [name] sections with model = SOURCE and that model's own flags (ctx-size, "
              "parallel, cache-type-k, ...), pin = true to load at start and never evict"),
    Flag(("--models-memory-budget",), "models_memory_budget",
         help="bytes (K/M/G) the loaded models may take together, weights + KV pool + recurrent state as "
              "allocated; the least recently used idle model is unloaded to make room (none = no cap)"),
    Flag(("--models-max",), "models_max", int, "most models loaded at once (least recently used idle one unloaded)"),
    Flag(("--no-models-autoload",), "models_autoload", switch=True, negate=True,
         help="do not load a model on its first request: only POST /models/load (and pinned models) load"),
    Flag(("--models-contention",), "models_contention", choices=CONTENTION_POLICIES,
         help="a load that does not fit while every loaded model is busy: fail (503 at once), wait (until one "
              "is idle), preempt (suspend the least recently used busy model: its requests wait, parked, and go "
              "on when it returns), wait_then_fail / wait_then_preempt (after --models-wait-timeout)"),
    Flag(("--models-wait-timeout",), "models_wait_timeout", float,
         help="seconds a request waits for room under wait_then_fail and wait_then_preempt"),
    Flag(("--models-background-share",), "models_background_share", float,
         help="share of the cores embedding and reranking models get while generating models stream: the "
              "engines take turns, a chat's step waits at most about share/(1-share) of itself (1 = no turns: "
              "every engine steps at once, on every core)"),
    Flag(("--models-load-duty",), "models_load_duty", float,
         help="share of the time a model's load works while other models stream; it rests the rest, so its memory "
              "traffic slows their steps less (0.5: a load beside streams takes about twice as long; 1 = no rests)"),
    Flag(("--node-role",), "node_role", choices=NODE_ROLES,
         help="disaggregated serving role (absent = single node); see docs/distributed.md"),
    Flag(("--serving-bind",), "serving_bind", help="this node's role-transport listener, host:port"),
    Flag(("--decode-peers",), "decode_peers",
         help="router: the decode pool; prefill: fallback decode nodes when the router names none (a,b)"),
    Flag(("--prefill-peers",), "prefill_peers",
         help="router: the prefill pool; decode: hosts it accepts handoffs from (a,b)"),
    Flag(("--decode-allowlist",), "decode_allowlist", extra_env=("MLXCEL_DECODE_ALLOWLIST",),
         help="prefill: numeric IP:port list that a router-chosen decode_target must be in (unset = any)"),
    Flag(("--health-check-interval",), "health_check_interval", float,
         help="router: seconds between TCP probes of every peer's serving address"),
]

_FLAG_BY_DEST: dict[str, Flag] = {}
for _flag in FLAGS:  # the first flag of a dest owns its env var (later ones are spellings)
    _FLAG_BY_DEST.setdefault(_flag.dest, _flag)


@dataclass(frozen=True)
class EnvAlias:
    """A seed (mlxcel) environment variable read as one of ours; ours win when both are set."""

    name: str
    dest: str
    convert: Callable[[str], str] = str  # the seed's value -> our value's text

    def value_text(self, raw: str) -> str:
        return self.convert(raw)


def _mixed_step(raw: str) -> str:
    return "mixed" if _bool(raw) else "alternate"


def _pin(raw: str) -> str:
    return "enable" if _bool(raw) else "decline"


def _adaptive(raw: str) -> str:
    return "adaptive" if _bool(raw) else "enable"  # the seed's static default enables


# Every MLXCEL_* the seeds name for a feature conveyor has (docs/server.md lists the rest and why not).
SEED_ENV_ALIASES: tuple[EnvAlias, ...] = (
    EnvAlias("MLXCEL_PREFILL_CHUNK", "prefill_chunk_size"),
    EnvAlias("MLXCEL_MIXED_STEP", "tick_policy", _mixed_step),
    EnvAlias("MLXCEL_KV_ADMISSION_WATERMARK", "kv_admission_watermark"),
    EnvAlias("MLXCEL_KV_CACHE_BUDGET", "kv_cache_budget"),
    EnvAlias("MLXCEL_MAX_BATCH_PREFILL_TOKENS", "max_batch_prefill_tokens"),
    EnvAlias("MLXCEL_CACHE_DIR", "cache_dir"),
    EnvAlias("MLXCEL_ENABLE_MTP_B1", "draft_policy", _pin),
    EnvAlias("MLXCEL_MTP_ADAPTIVE", "draft_policy", _adaptive),
)

_CONFIG_CLASSES = (EngineConfig, ServerConfig, ClusterConfig, ModelsConfig)


def flag_default(flag: Flag) -> str:
    """The default as `--help` prints it and docs/server.md states it: on/off for switches, none for None."""
    for cls in _CONFIG_CLASSES:
        for f in fields(cls):
            if f.name == flag.dest:
                if flag.switch:
                    return "on" if f.default != flag.negate else "off"
                return "none" if f.default is None else str(f.default)
    return "none"


def add_flags(parser: argparse.ArgumentParser, dests: set[str] | None = None) -> None:
    """Add the flags (all, or those whose dest is listed) with defaults left unset (None)."""
    for flag in FLAGS:
        if dests is not None and flag.dest not in dests:
            continue
        help_text = f"{flag.help} (default: {flag_default(flag)}) [env {flag.env_hint}]".replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": flag.dest, "default": None, "help": help_text}
        if flag.repeat:
            kwargs["action"] = "append"
        if flag.switch:
            kwargs["action"] = "store_const"
            kwargs["const"] = not flag.negate
        else:
            kwargs["type"] = _refusing(flag)
            if flag.choices:
                kwargs["choices"] = flag.choices
        parser.add_argument(*flag.names, **kwargs)


def _refusing(flag: Flag) -> Callable[[str], Any]:
    """flag.type, but a refused seed value fails with its own message (argparse's names only the choices)."""
    def convert(text: str) -> Any:
        message = flag.refusal(text)
        if message:
            raise argparse.ArgumentTypeError(message)
        return flag.type(text)

    convert.__name__ = getattr(flag.type, "__name__", "value")  # argparse's "invalid int value" wording
    return convert


def _env_value(flag: Flag, text: str) -> Any:
    # NOTE: the variable names the field, not the flag, so a switch's text is the field's value as
    # is; `negate` belongs to the `--no-*` spelling only (applying it here inverted the variable).
    _require(flag.refusal(text) is None, flag.refusal(text) or "")
    return _bool(text) if flag.switch else flag.type(text)


def _from_env(flag: Flag, env: dict[str, str]) -> tuple[Any, str | None]:
    """(value, the variable it came from): ours, then llama.cpp's, then the seeds' aliases."""
    seeds = {alias.name: alias.value_text for alias in SEED_ENV_ALIASES if alias.dest == flag.dest}
    for name in (flag.env, *flag.extra_env, *seeds):
        if name not in env:
            continue
        try:
            return _env_value(flag, seeds.get(name, str)(env[name])), name
        except ValueError as exc:  # ConfigError included
            raise ConfigError(f"{name}={env[name]!r}: {exc}") from None
    return None, None


def _from_sources(cls: type, args: argparse.Namespace | None, env: dict[str, str], overrides: dict[str, Any]) -> Any:
    values: dict[str, Any] = {}
    for f in fields(cls):
        flag = _FLAG_BY_DEST.get(f.name)
        value = overrides.get(f.name)
        if value is None and args is not None:
            value = getattr(args, f.name, None)
            if isinstance(value, list):  # a repeatable flag: one value is this field's; several are ModelsConfig's
                value = value[0] if len(value) == 1 else None
        if value is None and flag is not None:
            value, _ = _from_env(flag, env)
        if value is not None:
            values[f.name] = value
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc


def env_alias_report(args: argparse.Namespace | None = None, env: dict[str, str] | None = None) -> list[str]:
    """One line per seed (MLXCEL_*) variable that is set: used for which field, or why not (startup log)."""
    env = dict(os.environ) if env is None else env
    lines = []
    for alias in SEED_ENV_ALIASES:
        if alias.name not in env:
            continue
        flag = _FLAG_BY_DEST[alias.dest]
        if args is not None and getattr(args, alias.dest, None) is not None:
            lines.append(f"{alias.name} ignored: the command line sets {alias.dest}")
            continue
        _, source = _from_env(flag, env)
        if source == alias.name:
            lines.append(f"{alias.name}={env[alias.name]} used for {alias.dest} (seed alias of {flag.env})")
        else:
            lines.append(f"{alias.name} ignored: {source} is set and wins")
    return lines


def load_configs(args: argparse.Namespace | None = None, env: dict[str, str] | None = None,
                 **overrides: Any) -> tuple[EngineConfig, ServerConfig]:
    """Precedence: explicit override > CLI flag > environment variable > dataclass default."""
    env = dict(os.environ) if env is None else env
    return (_from_sources(EngineConfig, args, env, overrides), _from_sources(ServerConfig, args, env, overrides))


def engine_config_from_env(env: dict[str, str] | None = None) -> EngineConfig:
    """EngineConfig as the environment alone sets it (no command line, no overrides)."""
    return _from_sources(EngineConfig, None, dict(os.environ) if env is None else env, {})


def kernel_settings_from_env(env: dict[str, str] | None = None) -> "KernelSettings":
    """The kernel knobs as CONVEYOR_KERNEL_ARCH / _REQUIRE_KERNELS / _DISABLE_KERNEL set them (tests, tools)."""
    return engine_config_from_env(env).kernel_settings


def load_cluster_config(args: argparse.Namespace | None = None, env: dict[str, str] | None = None,
                        **overrides: Any) -> ClusterConfig:
    env = dict(os.environ) if env is None else env
    return _from_sources(ClusterConfig, args, env, overrides)


def load_models_config(args: argparse.Namespace | None = None, env: dict[str, str] | None = None,
                       **overrides: Any) -> ModelsConfig:
    env = dict(os.environ) if env is None else env
    given = getattr(args, "model", None) if args is not None else None
    if isinstance(given, list) and len(given) > 1:
        overrides.setdefault("models", tuple(given))
    return _from_sources(ModelsConfig, args, env, overrides)


def describe(*configs: Any) -> str:
    """The effective configuration as one readable block (logged at startup)."""
    lines = []
    for config in configs:
        lines.append(f"[{type(config).__name__}]")
        for f in fields(config):
            value = getattr(config, f.name)
            if f.name == "api_key" and value:
                value = "***"
            lines.append(f"  {f.name:<24} {value}")
    return "\n".join(lines)
