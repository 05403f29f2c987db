"""EngineCore: the step loop (schedule -> execute -> update) plus output processing."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from conveyor.config import EngineConfig, parse_kv_budget, parse_preload_bytes
from conveyor.engine.background import PacedWeights, idle_priority
from conveyor.engine.block_pool import BlockPool
from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.engine.disk_store import STATE, WINDOW
from conveyor.engine.draft_setup import load_dflash_head, load_draft_model, load_eagle3_head, load_mtp_head
from conveyor.engine.kv_cache_manager import KVCacheManager
from conveyor.engine.kv_transfer import KVTransfer
from conveyor.engine.load_progress import LoadProgress
from conveyor.engine.memory import KVPoolPlan, WindowGroupNeed, plan_kv_pool
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.pooling_setup import pooling_weight_dtype, resolve_pooling
from conveyor.engine.prefix_disk import DiskTier, build_disk_tier
from conveyor.engine.request import Request, RequestStatus
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.scheduler import Scheduler
from conveyor.engine.scheduling_policy import SchedulerConfig, prefill_tokens_per_tick
from conveyor.engine.spec_policy import SpecPolicy, machine_id
from conveyor.engine.state_pool import StatePool
from conveyor.engine.window_blocks import WindowBlocks
from conveyor.errors import InvalidRequestError
from conveyor.kernels import KernelBackend, resolve_backend
from conveyor.kernels.kv_quant import KVCacheTypes
from conveyor.loading import Checkpoint, Tokenizer, load_checkpoint
from conveyor.loading.heap import trim_heap
from conveyor.loading.mmproj import read_mmproj
from conveyor.models.config import ModelConfigError
from conveyor.models.dflash import DFlashHead
from conveyor.models.eagle3 import Eagle3Head
from conveyor.models.mtp import MTPHead
from conveyor.models.pooling import Pooler, PoolingConfig
from conveyor.models.registry import build_model
from conveyor.multimodal.encoder_cache import EncoderCache
from conveyor.multimodal.image_input import ImageInput
from conveyor.multimodal.vision import VisionModel, build_vision
from conveyor.models.weights import count_params, describe_formats, weight_bytes_by_format
from conveyor.runner.draft_runner import DraftRunner
from conveyor.runner.dflash_runner import DFlashRunner
from conveyor.runner.mtp_runner import Eagle3Runner, MTPRunner
from conveyor.models.cache_specs import KVSpec, has_latent_kv, kv_window, state_bytes_per_slot
from conveyor.runner.model_runner import ModelRunner, kv_group_bytes_per_block
from conveyor.structured.compiler import GrammarCompiler
from conveyor.structured.masks import GrammarMasker, MaskJob

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
# A tick with nothing to run waits this long at most for a prefix read from disk (then commands are drained).
DISK_READ_POLL_S = 0.02
DRAFT_STATE_ROWS = 4  # drafting rows of a hybrid that keep a state snapshot per draft (see _state_pool)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        return torch.device("mps" if mps is not None and mps.is_available() else "cpu")
    return torch.device(name)


def prompt_cache_blocks(budget: str, bytes_per_block: int) -> int | None:
    """--prompt-cache-budget in blocks: how many cold cached prefix blocks the pool keeps (None = no own cap)."""
    value = parse_kv_budget(budget)
    if value is None or value == -1 or not bytes_per_block:
        return None
    return max(value // bytes_per_block, 0)


def _check_kv_types(kv_types: KVCacheTypes, specs: list) -> None:
    """q8_0 needs every attention layer's head_dim to be whole 32-value blocks: refused at startup otherwise."""
    for spec in specs:
        if isinstance(spec, KVSpec):
            try:
                kv_types.check_head_dim(spec.head_dim)
            except ValueError as exc:
                raise ModelConfigError(str(exc)) from None


def _check_latent_kv(config: EngineConfig, specs: list) -> None:
    """MLA layers keep one latent row per token and read their values from it (models/mla.py). A q8_0 cache
    quantizes that row (K and V are one tensor, so both types must agree). The disk tier, saved slots and the KV
    handoff move that one tensor per layer (ModelRunner.kv_layer_tensors)."""
    if not has_latent_kv(specs):
        return
    if config.cache_type_k != config.cache_type_v:
        raise ModelConfigError(f"--cache-type-k {config.cache_type_k} with --cache-type-v {config.cache_type_v}: a "
                               "model with multi-head latent attention keeps K and V in one latent row per token; "
                               "give both the same type")


def resolve_dtype(name: str) -> torch.dtype:
    return torch.bfloat16 if name == "auto" else _DTYPES[name]


@dataclass
class EngineCounters:
    num_steps: int = 0
    num_failed_steps: int = 0
    consecutive_failures: int = 0
    batch_size_counts: dict[int, int] = field(default_factory=dict)  # rows per forward -> forwards


@dataclass
class ParkedRequest:
    """An unfinished request of a suspended core (EngineCore.suspend), with what its stream goes on from."""

    request: Request
    detokenizer: IncrementalDetokenizer | None
    rng_state: bytes | None  # a seeded request's generator


class EngineCore:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None,
                 draft_checkpoint: Checkpoint | None = None, progress: LoadProgress | None = None,
                 load_threads: int = 0, load_duty: float = 1.0) -> None:
        """load_threads: intra-op threads while loading (0: as when serving). A multi-model server loads with
        one while other models stream, at idle priority where it can (engine/background.py), so their steps
        keep the cores (the kernels' pool included); load_duty < 1: resting between tensors (PacedWeights)."""
        self._load_duty = load_duty
        if not (load_threads or config.threads):
            self._build(config, checkpoint, draft_checkpoint, progress)
            return
        serving_threads = config.threads or torch.get_num_threads()
        torch.set_num_threads(load_threads or serving_threads)  # this thread's; others keep theirs
        try:
            with idle_priority() if load_threads == 1 else contextlib.nullcontext():
                self._build(config, checkpoint, draft_checkpoint, progress)
        finally:
            torch.set_num_threads(serving_threads)

    def _build(self, config: EngineConfig, checkpoint: Checkpoint | None, draft_checkpoint: Checkpoint | None,
               progress: LoadProgress | None) -> None:
        self.config = config
        progress = progress or LoadProgress()
        if checkpoint is None:
            progress.set_stage("reading the checkpoint")
            checkpoint = load_checkpoint(config.model, hf_file=config.hf_file, revision=config.revision,
                                         on_download=progress.download)
        self.model_name = checkpoint.name
        self.model_config = checkpoint.config
        self.tokenizer: Tokenizer = checkpoint.tokenizer
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype)
        progress.set_stage("kernels")  # the first start compiles them (kernels/build.py logs how long)
        # The compute backend is resolved once, here, and handed to every layer and the sampler.
        self.backend: KernelBackend = resolve_backend(self.device, self.dtype, config.kernel_settings,
                                                      config.batch_invariant)
        logger.info("%s", self.backend.summary())
        if not self.backend.batch_invariant:
            logger.warning("batch invariance is OFF on this backend (%s): greedy outputs may depend on "
                           "batch-mates, and speculative decoding is disabled", self.backend.name)
        progress.set_stage("weights")
        weights = progress.track(checkpoint.weights)
        if self._load_duty < 1:
            weights = PacedWeights(weights, self._load_duty)
        model = build_model(checkpoint.config, weights, self.dtype, self.device,
                            config.batch_invariant, pooling_weight_dtype(config, checkpoint, self.backend.name),
                            ops=self.backend,
                            release=checkpoint.release_pages)
        trim_heap()  # packing's freed temporaries: without this RSS stays ~1.3x the weights of a big file
        # Bytes as kept (GGML blocks, packed bf16, int8): what the weights cost, for the KV pool plan.
        self.weight_formats = weight_bytes_by_format(model)
        weight_bytes = sum(self.weight_formats.values())
        logger.info("weights: %s", describe_formats(self.weight_formats))
        # Parameter count as model cards state it: a tied head is the embedding, counted once.
        self.num_params = count_params(model, checkpoint.config.tie_word_embeddings)
        # A vision-language checkpoint: its processor and tower (multimodal/vision.py); None for a text model.
        vision = checkpoint.vision
        if vision is None and config.mmproj:  # a GGUF text model and llama.cpp's projector file beside it
            vision = read_mmproj(config.mmproj, checkpoint.tokenizer, checkpoint.config)
        elif config.mmproj:
            logger.warning("--mmproj %s ignored: %s has its own vision tower", config.mmproj, checkpoint.source)
        self.vision: VisionModel | None = (build_vision(vision, checkpoint.tokenizer, self.dtype, self.device,
                                                        ops=self.backend) if vision is not None else None)
        # An embedder or reranker (or --embeddings): requests pool their prompt instead of generating.
        self.pooling: PoolingConfig | None = resolve_pooling(config, checkpoint, model)
        progress.set_stage("draft model and KV cache")
        self.draft = (load_draft_model(config, checkpoint, draft_checkpoint, self.dtype, self.device, self.backend)
                      or load_mtp_head(config, checkpoint, model, self.dtype, self.device, self.backend)
                      or load_eagle3_head(config, checkpoint, model, self.dtype, self.device, self.backend)
                      or load_dflash_head(config, checkpoint, model, self.dtype, self.device, self.backend))
        specs = model.cache_specs()
        # --cache-type-k / -v: every attention layer (full, sliding, a hybrid's, the draft's) keeps K/V this way.
        self.kv_types = KVCacheTypes(config.cache_type_k, config.cache_type_v)
        _check_kv_types(self.kv_types, specs + (self.draft.model.cache_specs() if self.draft is not None else []))
        _check_latent_kv(config, specs + (self.draft.model.cache_specs() if self.draft is not None else []))
        # Sliding layers keep their K/V in a group of their own, given back behind the window (0: one group).
        self.sliding_window = kv_window(specs)
        bytes_per_block, window_bytes_per_block = kv_group_bytes_per_block(specs, config.block_size, self.dtype,
                                                                           self.kv_types)
        # The draft's KV lives in the same blocks (own tensors), so a block costs both models' bytes; it follows
        # the full group's table, every layer of it.
        if self.draft is not None:
            bytes_per_block += sum(kv_group_bytes_per_block(self.draft.model.cache_specs(), config.block_size,
                                                            self.dtype, self.kv_types))
        self.max_batch_size = config.effective_max_batch_size
        self.states = self._state_pool(config, specs)
        self.pool_plan: KVPoolPlan = plan_kv_pool(
            model_max_len=checkpoint.config.max_position_embeddings, ctx_size=config.ctx_size,
            num_slots=self.max_batch_size, kv_unified=config.effective_kv_unified, block_size=config.block_size,
            bytes_per_block=bytes_per_block, budget=parse_kv_budget(config.kv_cache_budget),
            weight_bytes=weight_bytes, max_kv_tokens=config.max_kv_size,
            state_bytes=self.states.total_bytes if self.states is not None else 0,
            window_group=self._window_need(config, window_bytes_per_block))
        self.max_model_len = self.pool_plan.max_model_len
        # The prompt-cache budget keeps as many cold blocks in each group as one block of both costs.
        cached_cap = prompt_cache_blocks(config.prompt_cache_budget, bytes_per_block + window_bytes_per_block)
        self.pool = BlockPool(self.pool_plan.num_blocks, enable_caching=config.enable_prefix_caching,
                              max_cached_free=cached_cap)
        window = None
        if self.sliding_window:
            window = WindowBlocks(BlockPool(self.pool_plan.window_blocks, enable_caching=config.enable_prefix_caching,
                                            max_cached_free=cached_cap), config.block_size, self.sliding_window)
        self.kv = KVCacheManager(self.pool, config.block_size, self.states, window,
                                 snapshot_interval=config.state_snapshot_interval)
        self.scheduler = Scheduler(SchedulerConfig(
            max_batch_size=self.max_batch_size, max_model_len=self.max_model_len,
            prefill_chunk_size=config.prefill_chunk_size, prefill_grant_interval=config.prefill_grant_interval,
            max_batch_prefill=1 if config.no_batch else config.max_batch_prefill,
            max_batch_prefill_tokens=config.max_batch_prefill_tokens,
            tick_policy=config.tick_policy, enable_preemption=config.enable_preemption,
            priority_aging_s=config.priority_aging_s,
            preemption_policy=config.preemption_policy, kv_admission_watermark=config.kv_admission_watermark,
            watermark_applies=self.pool_plan.budget_bytes is not None,
            speculative_ngram=self._speculation_allowed(config), speculative_max_rows=config.speculative_max_rows,
            prompt_lookup_max_batch=config.prompt_lookup_max_batch,
            draft_model_tokens=min(config.draft_block_size, self.draft.max_tokens) if self.draft is not None else 0),
            self.kv,
            stop_checker=self._stop_string_ends)
        self.spec_policy = self._draft_policy(config, checkpoint.name)
        if self.spec_policy is not None:
            self.scheduler.draft_length = self.spec_policy.draft_length
        self.runner = ModelRunner(model, checkpoint.config, self.pool_plan.num_blocks, config.block_size, self.dtype,
                                  self.device, self.backend, seed=config.seed, drafter=self._drafter(config),
                                  num_state_slots=self.states.num_slots if self.states is not None else 0,
                                  num_window_blocks=self.pool_plan.window_blocks, kv_types=self.kv_types,
                                  pooler=Pooler(self.pooling) if self.pooling is not None else None,
                                  encoder_cache=EncoderCache(self.vision.encoder) if self.vision is not None else None)
        if self.runner.encoder_cache is not None:  # the tower runs on its own thread; prefills wait for it
            self.scheduler.image_ready = self.runner.encoder_cache.ready
        # Tensors, not layers: a future KV layout (quantized blocks, scales) is stored as whatever the pool holds.
        kv_tensors, window_tensors = [], []
        for layer, windowed in zip(self.runner.kv_layer_tensors(), self.runner.kv_layer_windowed()):
            (window_tensors if windowed else kv_tensors).extend(layer)
        state_tensors = [t for layer in self.runner.state_layers() for t in layer]
        self.disk: DiskTier | None = build_disk_tier(config, checkpoint, kv_tensors,
                                                     {WINDOW: window_tensors, STATE: state_tensors})
        if self.disk is not None:
            self.kv.attach_disk(self.disk)
            preload = parse_preload_bytes(config.prompt_cache_preload)
            if self.disk.consult and preload:
                started = time.perf_counter()
                count = self.disk.preload(self.pool, preload)
                if count:
                    logger.info("prompt cache disk: %d blocks (%.1f MiB) read into the RAM prefix cache in %.2f s",
                                count, count * self.disk.block_bytes / 2**20, time.perf_counter() - started)
        # Slot id -> the request that last ran there, or the tokens a slot restore put there (llama-server's
        # slots keep their last prompt; engine/slot_store.py).
        self.slot_contents: dict[int, Request | list[int]] = {}
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(checkpoint.config.eos_token_ids)
        self.counters = EngineCounters()
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.kv_transfer = KVTransfer(self)  # disaggregated roles only; inert otherwise
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request
        self._masker: GrammarMasker | None = None
        del checkpoint  # its tensors (file views, or the HF loader's copies) are no longer needed
        logger.info("KV pool: %d blocks x %d tokens (%.1f MiB, budget %s, K %s / V %s), %d tokens per slot",
                    self.pool_plan.num_blocks, config.block_size, self.pool_plan.pool_bytes / 2**20,
                    self.pool_plan.budget_source, self.kv_types.k, self.kv_types.v, self.max_model_len)
        if self.sliding_window:
            logger.info("sliding layers (window %d): %d blocks of their own (%.1f MiB), given back behind the window",
                        self.sliding_window, self.pool_plan.window_blocks, self.pool_plan.window_pool_bytes / 2**20)
        progress.finish()

    def _state_pool(self, config: EngineConfig, specs: list) -> StatePool | None:
        """Hybrid models: one recurrent-state slot per sequence slot, one per row that may draft in a tick (its
        rollback point) and the prefix snapshots; none for a model without recurrent layers."""
        bytes_per_slot = state_bytes_per_slot(specs)
        draft_bytes = state_bytes_per_slot(self.draft.model.cache_specs()) if self.draft is not None else 0
        if not bytes_per_slot:
            if draft_bytes:
                raise ModelConfigError("a hybrid (recurrent) draft model needs a hybrid target: its states live in "
                                       "the target's state slots (and roll back through them); use an attention-only "
                                       "draft model for this target")
            return None
        # A hybrid draft keeps its state in its own tensors under the same slot ids (as its K/V under the same
        # block ids), so a slot costs both models' bytes.
        bytes_per_slot += draft_bytes
        # A drafting row adds at least one token to the tick's speculative_max_rows, so at most half of them draft.
        speculating = (min(self.max_batch_size, config.speculative_max_rows // 2)
                       if (config.ngram_enabled or self.draft is not None) else 0)
        # A drafter's rows also keep the state after each draft but the last (Scheduler._plan_draft_states), for
        # the first DRAFT_STATE_ROWS of them: past a few rows drafting seldom pays, and a miss's recompute rides
        # in the batch; rows without them recompute their accepted drafts.
        drafts = min(config.draft_block_size, self.draft.max_tokens) if self.draft is not None else 1
        draft_states = min(speculating, DRAFT_STATE_ROWS) * (drafts - 1)
        snapshots = config.state_snapshots if config.enable_prefix_caching else 0
        pool = StatePool(self.max_batch_size + speculating + draft_states + snapshots, bytes_per_slot, snapshots,
                         max_spare=draft_states)
        logger.info("recurrent state: %d slots x %.2f MiB (%d sequences, %d rollback, %d draft states, %d prefix "
                    "snapshots)", pool.num_slots, bytes_per_slot / 2**20, self.max_batch_size, speculating,
                    draft_states, snapshots)
        return pool

    def _window_need(self, config: EngineConfig, bytes_per_block: int) -> WindowGroupNeed | None:
        """What the sliding group needs: each sequence's window plus the most tokens one tick prefills
        (the longest chunk, or a batched prefill's token cap; see Scheduler._admit)."""
        if not self.sliding_window:
            return None
        rows = 1 if config.no_batch else config.max_batch_prefill
        tick = prefill_tokens_per_tick(config.prefill_chunk_size, rows, config.max_batch_prefill_tokens)
        return WindowGroupNeed(self.sliding_window, bytes_per_block, tick, rows)

    def _drafter(self, config: EngineConfig) -> DraftRunner | MTPRunner | DFlashRunner | None:  # Eagle3Runner: MTP's
        if self.draft is None:
            if config.draft_p_min > 0:  # llama-server ignores it silently; say so once
                logger.warning("--draft-p-min %g has no effect: it cuts a model drafter's drafts (--draft-model, "
                               "--draft-kind mtp|eagle3|dflash) and none is loaded", config.draft_p_min)
            return None
        if isinstance(self.draft.model, (MTPHead, Eagle3Head, DFlashHead)):
            runner = ModelRunner(self.draft.model, self.draft.config, self.pool_plan.num_blocks, config.block_size,
                                 self.dtype, self.device, self.backend, seed=config.seed + 1, kv_types=self.kv_types)
            # NOTE: zeros, not the pool's empty pages: a position the head never wrote (a cached block's last row,
            # whose next token came later) may be read; stale K/V lowers acceptance, garbage could be NaN.
            for layer in runner.kv_layer_tensors():
                for tensor in layer:
                    tensor.zero_()
            if isinstance(self.draft.model, DFlashHead):
                return DFlashRunner(runner, config.draft_p_min)
            kind = Eagle3Runner if isinstance(self.draft.model, Eagle3Head) else MTPRunner
            return kind(runner, config.draft_p_min)
        recurrent = bool(state_bytes_per_slot(self.draft.model.cache_specs()))
        runner = ModelRunner(self.draft.model, self.draft.config, self.pool_plan.num_blocks, config.block_size,
                             self.dtype, self.device, self.backend, seed=config.seed + 1, kv_types=self.kv_types,
                             num_state_slots=self.states.num_slots if recurrent else 0)
        return DraftRunner(runner, recurrent=recurrent, p_min=config.draft_p_min)

    def _draft_policy(self, config: EngineConfig, target_name: str) -> SpecPolicy | None:
        if self.draft is None:
            return None
        block_size = min(config.draft_block_size, self.draft.max_tokens)  # (a DFlash drafter: its block - 1 at most)
        key = {"target": target_name, "draft": self.draft.name, "draft_block_size": str(block_size),
               "backend": f"{self.backend.name}/{self.backend.arch}", "machine": machine_id(),
               "threads": str(torch.get_num_threads())}
        return SpecPolicy(config.draft_policy, key, config.cache_dir or None, block_size=block_size)

    def _speculation_allowed(self, config: EngineConfig) -> int:
        """Drafts are only exact where a verified row equals a decoded one bit for bit: a backend
        with batch invariance. Elsewhere (CUDA, no compiler, --no-batch-invariant) whether a row
        drafts would depend on its batch-mates, so speculation is switched off."""
        if not config.ngram_enabled:
            return 0
        if not self.backend.speculation:
            logger.info("speculative decoding off: it needs a batch-invariant backend (this one: %s)",
                        self.backend.name)
            return 0
        return config.speculative_ngram

    def kernel_report(self) -> dict:
        """What /props, /health and the metrics say about the compute backend."""
        return {"backend": self.backend.name, "arch": self.backend.arch,
                "batch_invariant": self.backend.batch_invariant,
                "speculation": self.scheduler.config.speculative_ngram > 0 or self.draft is not None}

    def weights_report(self) -> dict:
        """What /props says about the weights: --weight-dtype and the bytes kept in each format."""
        qgemm = self.backend.qgemm
        return {"weight_dtype": self.config.weight_dtype, "formats": dict(self.weight_formats),
                "bytes": sum(self.weight_formats.values()),
                "quantized_kernel": qgemm.backend() if qgemm is not None else None}

    def memory_report(self) -> dict[str, int]:
        """Bytes this model holds as allocated (a multi-model server's budget counts them): the weights as
        kept (the draft model's too), the KV pool as reserved, the recurrent-state slots."""
        draft = sum(weight_bytes_by_format(self.draft.model).values()) if self.draft is not None else 0
        report = {"weights": sum(self.weight_formats.values()) + draft, "kv_cache": self.pool_plan.pool_bytes,
                  "state": self.states.total_bytes if self.states is not None else 0}
        return {**report, "total": sum(report.values())}

    def layers_report(self) -> dict:
        """What /props and /v1/models say about the layers: how many of each kind, and what a sequence's
        recurrent state costs (hybrid models; 0 for attention-only ones)."""
        cfg = self.model_config
        kinds: dict[str, int] = {}
        for i in range(cfg.num_hidden_layers):
            kinds[cfg.layer_kind(i)] = kinds.get(cfg.layer_kind(i), 0) + 1
        plan = self.pool_plan  # K/V bytes one token costs over every attention layer (MLA: its latent rows)
        return {"layer_kinds": kinds, "attention_layers": cfg.num_attention_layers,
                "kv_bytes_per_token": (plan.bytes_per_block + plan.window_bytes_per_block) // self.kv.block_size,
                "latent_kv": has_latent_kv(self.runner.cache_specs),
                "state_bytes_per_sequence": self.states.bytes_per_slot if self.states is not None else 0}

    def state_report(self) -> dict | None:
        """/v1/cache/stats, /metrics and the web page: the recurrent-state slots (None without any)."""
        if self.states is None:
            return None
        stats = self.states.stats()
        return {"slots": stats.num_slots, "live": stats.num_live, "scratch": stats.num_scratch,
                "snapshots": stats.num_snapshots, "max_snapshots": self.states.max_snapshots,
                "max_draft_states": self.states.max_spare, "free": stats.num_free,
                "bytes_per_slot": stats.bytes_per_slot, "bytes_reserved": self.states.total_bytes,
                "bytes_in_use": (stats.num_live + stats.num_scratch + stats.num_snapshots) * stats.bytes_per_slot,
                "snapshot_hits": stats.num_snapshot_hits, "snapshot_evictions": stats.num_snapshot_evictions}

    def window_report(self) -> dict | None:
        """/v1/cache/stats: the sliding layers' own block group (None for a model with one group)."""
        if self.kv.window is None:
            return None
        stats = self.kv.window.pool.stats()
        per_block = self.pool_plan.window_bytes_per_block
        return {"window": self.sliding_window, "allocated": stats.num_blocks, "live": stats.num_used,
                "free": stats.num_free, "cached": stats.num_cached, "cached_free": stats.num_cached_free,
                "shared": stats.num_shared, "evictions": stats.num_evictions, "bytes_per_block": per_block,
                "bytes_reserved": stats.num_blocks * per_block, "bytes_in_use": stats.num_used * per_block}

    def disk_report(self) -> dict | None:
        """/v1/cache/stats, /metrics and the web page: the prefix cache's disk tier (None without one)."""
        if self.disk is None:
            return None
        return {**self.disk.report(), "hit_tokens": self.kv.counters.disk_hit_tokens}

    def ram_report(self) -> dict:
        """The prefix cache's RAM tier, in the disk tier's terms."""
        stats = self.pool.stats()
        per_block = self.pool_plan.bytes_per_block
        cap = self.pool.max_cached_free
        return {"entries": stats.num_cached, "bytes": stats.num_cached * per_block,
                "budget_bytes": cap * per_block if cap is not None else None,
                "hit_tokens": self.kv.counters.hit_tokens, "evictions": stats.num_evictions}

    def close(self) -> None:
        """Shutdown: the RAM prefix cache goes to the disk tier, and the writer finishes (engine thread)."""
        self.kv.close_disk()
        if self.runner.encoder_cache is not None:
            self.runner.encoder_cache.close()

    def speculation_report(self) -> dict:
        """What /props and /v1/internal/spec-policy say about speculative decoding."""
        stats = self.scheduler.stats
        config = self.scheduler.config
        return {"prompt_lookup": {"enabled": config.speculative_ngram > 0, "max_tokens": config.speculative_ngram,
                                  "max_batch": config.prompt_lookup_max_batch},
                "draft_model": {"enabled": self.draft is not None,
                                "name": self.draft.name if self.draft is not None else None,
                                # the drafter: a separate model, the target's own MTP head (--draft-kind mtp) or an
                                # EAGLE3 drafter (--draft-kind eagle3)
                                "kind": (None if self.draft is None
                                         else "mtp" if isinstance(self.draft.model, MTPHead)
                                         else "eagle3" if isinstance(self.draft.model, Eagle3Head)
                                         else "dflash" if isinstance(self.draft.model, DFlashHead) else "draft-model"),
                                "block_size": config.draft_model_tokens,
                                "draft_tokens": stats.num_model_draft_tokens,
                                "accepted_tokens": stats.num_model_accepted_tokens},
                "policy": self.spec_policy.report() if self.spec_policy is not None else None}

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles response_format / guided_* grammars (the tokenizer index costs ~0.1 s, so lazily)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                             self.config.grammar_cache_size, self.eos_token_ids)
            self._masker = GrammarMasker(self._grammars.vocab_size, self.model_config.vocab_size)
        return self._grammars

    @property
    def masker(self) -> GrammarMasker | None:
        return self._masker

    # -- requests --------------------------------------------------------------------------
    def next_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def make_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                     priority: int = 0, cache_prompt: bool = True, images: Sequence[ImageInput] = ()) -> Request:
        """Validate before admission: a bad request never reaches the scheduler. `images`: one per image marker in
        the prompt (the family's `<start_of_image>` or alike, VisionProcessor.image_marker), in order."""
        self.check_generates()
        params.validate(self.model_config.vocab_size)
        items = []
        if images:
            if self.vision is None:
                raise InvalidRequestError(f"{self.model_name} does not accept images (a text-only model)", "messages")
            expanded = self.vision.processor.expand(prompt_token_ids, images)
            prompt_token_ids, items = expanded.token_ids, expanded.items
        self._check_prompt(prompt_token_ids)
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens, but the context window is {self.max_model_len} "
                f"tokens (prompt plus at least one generated token must fit)", "messages")
        needed = self.kv.blocks_needed(min(len(prompt_token_ids) + params.max_tokens, self.max_model_len))
        if needed > self.pool.num_blocks:
            raise InvalidRequestError(f"request needs {needed} KV blocks but the pool has {self.pool.num_blocks}",
                                      "max_tokens")
        cache_prompt = cache_prompt and self.config.enable_prefix_caching and (self.config.vlm_prefix_cache or not items)
        request = Request(request_id or self.next_request_id(), list(prompt_token_ids), params, self.eos_token_ids,
                          priority=priority, cache_prompt=cache_prompt)
        request.images = items
        if images:
            request.rope_positions, request.rope_delta = expanded.rope_positions, expanded.rope_delta
        if params.structured is not None:
            request.grammar = self.grammars.new_state(params.structured)  # InvalidRequestError names the fault
        return request

    def check_generates(self) -> None:
        """InvalidRequestError for a pooling engine: an embedder or reranker answers no completions."""
        if self.pooling is not None:
            raise InvalidRequestError(f"{self.model_name} is an {self.pooling_task} model: it serves "
                                      f"{'/v1/rerank' if self.pooling_task == 'reranking' else '/v1/embeddings'}, "
                                      f"not completions", "model")

    @property
    def pooling_task(self) -> str | None:
        """"embedding" or "reranking" for a pooling engine, None for a generating one."""
        if self.pooling is None:
            return None
        return "reranking" if self.pooling.score is not None else "embedding"

    def make_pooling_request(self, prompt_token_ids: list[int], request_id: str | None = None,
                             priority: int = 0, token_type_ids: list[int] | None = None) -> Request:
        """An embedding (or a reranker's score) of one tokenized text: prefill only, nothing generated.
        `token_type_ids`: each token's segment, for encoders that read them (a BERT cross-encoder's pair)."""
        if self.pooling is None:
            raise InvalidRequestError(f"{self.model_name} generates text: it serves no embeddings or scores (start "
                                      f"it with --embeddings or --reranking, or serve an embedding model)", "model")
        self._check_prompt(prompt_token_ids)
        if len(prompt_token_ids) > self.max_model_len:
            raise InvalidRequestError(f"the input has {len(prompt_token_ids)} tokens, but the model's context is "
                                      f"{self.max_model_len} tokens (truncate_prompt_tokens cuts it on request)", "input")
        if self.kv.blocks_needed(len(prompt_token_ids)) > self.pool.num_blocks:
            raise InvalidRequestError(f"the input needs {self.kv.blocks_needed(len(prompt_token_ids))} KV blocks but "
                                      f"the pool has {self.pool.num_blocks}", "input")
        whole = self.model_config.bidirectional or self.pooling.whole_sequence
        # Whole-sequence rows cannot reuse a cached prefix (a mean needs every row; an encoder's K/V depends on
        # the tokens after it), nor leave theirs behind for others.
        request = Request(request_id or self.next_request_id(), list(prompt_token_ids), SamplingParams(max_tokens=1),
                          priority=priority, cache_prompt=self.config.enable_prefix_caching and not whole)
        request.pooling, request.pool_whole = True, whole
        # A model without a segment table reads every token as type 0, whatever its tokenizer's pair template says
        # (ModernBERT: transformers' takes no token_type_ids).
        if token_type_ids is not None and any(token_type_ids) and self.model_config.type_vocab_size:
            types = self.model_config.type_vocab_size
            if len(token_type_ids) != len(prompt_token_ids) or not all(0 <= t < types for t in token_type_ids):
                raise InvalidRequestError(f"token types must be one per token, each in [0, {types})", "input")
            request.token_type_ids = list(token_type_ids)
        return request

    def _check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if any(not 0 <= t < self.model_config.vocab_size for t in prompt_token_ids):
            raise InvalidRequestError("prompt contains token ids outside the vocabulary", "prompt")

    def add_request(self, request: Request) -> None:
        if request.pooling:  # nothing to detokenize
            self.scheduler.add_request(request)
            return
        params = request.sampling_params
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.stop, params.include_stop_str_in_output,
            params.skip_special_tokens)
        if request.output_token_ids:  # a handed-off sequence: the prefill node streamed these tokens' text
            detok = self._detokenizers[request.request_id]
            for token in request.output_token_ids:
                detok.add_token(token)
            detok.take_delta(False)
        if request.images:  # the tower starts now, off the step loop, on images the prefix cache does not cover
            covered = self.kv.ram_prefix_tokens(request)
            self.runner.encoder_cache.prefetch([item for item in request.images if item.end > covered])
        if not self.kv_transfer.admit(request):
            self.scheduler.add_request(request)

    def suspend(self) -> list[ParkedRequest]:
        """Free the model (weights, KV pool, states) for another to load; the unfinished requests come out with
        their detokenizers and seeded generators, to resume on a new core of this model (resume_parked). What
        is left (tokenizer, config, grammars) still validates requests meanwhile (make_request). Engine thread."""
        sampler = self.runner.sampler
        parked = [ParkedRequest(r, self._detokenizers.pop(r.request_id, None), sampler.generator_state(r.request_id))
                  for r in self.scheduler.take_all()]
        self.close()
        self.runner = self.draft = None  # the model's tensors (weights, KV, states): freed with their last reference
        return parked

    def resume_parked(self, parked: list[ParkedRequest], ids: Iterator[int]) -> None:
        """Take over what a suspended core of this model parked: each request re-prefills its prompt and the
        tokens it had generated, then goes on (bitwise, as after a preemption); request ids continue."""
        self._ids = ids
        for entry in parked:
            request = entry.request
            if request.grammar is not None:
                self.grammars  # the masker, built on the first constrained request
            if entry.rng_state is not None:
                self.runner.sampler.set_generator_state(request.request_id, entry.rng_state)
            if entry.detokenizer is None:
                self.add_request(request)
                continue
            self._detokenizers[request.request_id] = entry.detokenizer  # what it held back (a partial stop string)
            self.scheduler.add_request(request)

    def drop_detokenizer(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)

    def abort(self, request_id: str) -> RequestOutput | None:
        self.kv_transfer.forget(request_id)
        request = self.scheduler.finish(request_id, RequestStatus.FINISHED_CANCELLED)
        return self.final_output(request) if request is not None else None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        failed = self._fail_image_requests() if self.runner.encoder_cache is not None else []
        return failed + self._step() if failed else self._step()

    def _fail_image_requests(self) -> list[RequestOutput]:
        """Requests whose image the tower failed on end with that error; their batch-mates never see it."""
        failures = self.runner.encoder_cache.take_failures()
        if not failures:
            return []
        outputs = []
        for request in self.scheduler.waiting + self.scheduler.running:
            error = next((failures[i.content_hash] for i in request.images if i.content_hash in failures), None)
            if error is not None:
                finished = self.scheduler.finish(request.request_id, RequestStatus.FINISHED_ERROR,
                                                 f"vision encoder error: {error}")
                outputs.append(self.final_output(finished))
        return outputs

    def _step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        for slot, request in enumerate(self.scheduler.running):
            self.slot_contents[slot] = request
        if plan.is_empty and not plan.block_copies and not plan.window_block_copies and not plan.finished_request_ids:
            self.kv.wait_for_disk_reads(DISK_READ_POLL_S)  # nothing to run until a prefix read ends
            if self.runner.encoder_cache is not None:
                self.runner.encoder_cache.wait(DISK_READ_POLL_S)  # ... or an image's encode
            return []
        started = time.perf_counter()
        recorder = self.runner.drafter if isinstance(self.runner.drafter, MTPRunner) else None
        if recorder is not None and self.spec_policy is not None and not self.config.enable_prefix_caching:
            # (with prefix caching, a request's blocks outlive it: a later hit that drafts reads their head K/V)
            recorder.defer = self.spec_policy.defers_recording(len(plan.chunks))
        masks = self._start_masks(plan)
        try:
            # (masks passed only when there are some: execute(plan) stays the whole contract for free batches)
            result = self.runner.execute(plan, masks) if masks is not None else self.runner.execute(plan)
        except Exception as exc:  # a failed forward ends only the requests that were in it
            logger.exception("model step failed")
            if self.states is not None:
                self.kv.release_step(plan)
            self.counters.num_failed_steps += 1
            self.counters.consecutive_failures += 1
            failed = self.scheduler.finish_all([c.request_id for c in plan.chunks], RequestStatus.FINISHED_ERROR,
                                               f"inference backend error: {exc}")
            for request in failed:
                self.kv_transfer.forget(request.request_id)
            return [self.final_output(r) for r in failed]
        self.counters.consecutive_failures = 0
        self.counters.num_steps += 1
        counts = self.counters.batch_size_counts
        counts[len(plan.chunks)] = counts.get(len(plan.chunks), 0) + 1
        advanced = self.scheduler.update(plan, result)
        paid_deferred = recorder is not None and recorder.paid_deferred
        if recorder is not None:
            recorder.paid_deferred = False
        if self.spec_policy is not None and not paid_deferred:  # (a tick that ran rows kept earlier: not timed)
            self._observe_policy(plan, sum(n for _, n in advanced), time.perf_counter() - started)
        outputs = [self._output_for(r, n, result.logprobs.get(r.request_id)) for r, n in advanced]
        if self.kv_transfer.handoff_ids:
            self.kv_transfer.after_step(outputs)
        if not self.scheduler.has_work():
            self.kv.check_integrity()  # cheap when idle; proves nothing leaked
            if self.states is not None:
                assert self.states.all_free(), "a recurrent-state slot outlived its request"
        return outputs

    def _stop_string_ends(self, request: Request, token_id: int) -> bool:
        """The scheduler's stop checker: feeds each appended token to the request's detokenizer, so the
        scheduler decides the finish reason once (a stop string never relabels a finished request)."""
        detok = self._detokenizers.get(request.request_id)
        return detok is not None and detok.add_token(token_id)

    def _observe_policy(self, plan, num_tokens: int, seconds: float) -> None:
        """Feed pure decode ticks to the adaptive policy (a prefill in the tick would blur the comparison)."""
        if any(not c.sample or len(c.token_ids) - c.num_draft_tokens != 1 for c in plan.chunks):
            return
        speculative = any(c.draft is not None for c in plan.chunks)
        if not speculative and any(c.num_draft_tokens for c in plan.chunks):
            return  # prompt-lookup drafts only: neither a draft-model round nor a classic step
        self.spec_policy.observe(len(plan.chunks), speculative, num_tokens, seconds)

    def _start_masks(self, plan) -> MaskJob | None:
        """Grammar masks of the rows that sample this step, computed on a worker while the forward runs."""
        if self._masker is None:
            return None
        rows = []
        for chunk in plan.chunks:
            request = self.scheduler.requests.get(chunk.request_id)
            if chunk.sample and request is not None and request.grammar is not None:
                rows.append((chunk.request_id, request.grammar))
        return self._masker.start(rows)

    def _output_for(self, request: Request, num_new: int, logprob) -> RequestOutput:
        out = self._build_output(request, self._detokenizers.get(request.request_id))
        out.new_token_ids = request.output_token_ids[-num_new:] if num_new else []
        out.logprobs = [logprob] if logprob is not None else []
        return out

    def final_output(self, request: Request) -> RequestOutput:
        return self._build_output(request, self._detokenizers.get(request.request_id))

    def _build_output(self, request: Request, detok: IncrementalDetokenizer | None) -> RequestOutput:
        finished = request.is_finished
        text = detok.take_delta(finished) if detok is not None else ""
        if finished:
            self._detokenizers.pop(request.request_id, None)
        return RequestOutput(request.request_id, new_text=text, finished=finished,
                             finish_reason=request.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
                             num_output_tokens=len(request.output_token_ids),
                             num_cached_tokens=request.num_cached_tokens, error=request.error,
                             stop_sequence=detok.matched_stop if finished and detok is not None else None,
                             pooled=request.pooled)
