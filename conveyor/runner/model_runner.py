"""SchedulerOutput -> tensors -> one forward -> sampled tokens. Owns the KV cache tensors."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from conveyor.engine.outputs import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from conveyor.kernels import AttentionMetadata, KernelBackend
from conveyor.kernels.kv_quant import KVCacheTypes, bytes_per_row, cache_dtype, row_width
from conveyor.kernels.recurrent import StateMetadata
from conveyor.models.cache_specs import CacheSpec, KVSpec, StateSpec, in_window_group, kv_window
from conveyor.models.config import ModelConfig
from conveyor.models.pooling import Pooler, PoolingConfig, pool_rows
from conveyor.multimodal.encoder_cache import EncoderCache
from conveyor.runner.draft_runner import DraftRunner, Proposal
from conveyor.runner.mtp_runner import MTPRunner
from conveyor.runner.rejection import rejection_sample
from conveyor.runner.sampler import Sampler, SamplingRow

if TYPE_CHECKING:
    from conveyor.structured.masks import MaskJob


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # (R,) rows that sample
    sample_chunk_indices: list[int]  # chunk index of each sampled row (a chunk with drafts has several)
    # Pooling chunks: (chunk index, first row, rows) of what each pools, in order.
    pool_spans: list[tuple[int, int, int]] = field(default_factory=list)
    token_types: torch.Tensor | None = None  # (T,) an encoder's segment per row, where some chunk has types
    # Image rows: (row indices (E,), their embeddings (E, hidden)) put in place of the token embeddings; None: none.
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # (3, T) multimodal rotary positions (Qwen-VL's t, h, w), where some chunk has them; None: `positions`.
    rope_positions: torch.Tensor | None = None

    def model_kwargs(self) -> dict:
        """The optional forward arguments only the models that read them take."""
        kwargs = {} if self.embeds is None else {"embeds": self.embeds}
        if self.rope_positions is not None:
            kwargs["rope_positions"] = self.rope_positions
        return kwargs


def kv_group_bytes_per_block(specs: list[CacheSpec], block_size: int, dtype: torch.dtype,
                             kv_types: KVCacheTypes = KVCacheTypes()) -> tuple[int, int]:
    """K/V bytes of one block in (the full group, the sliding group) over the layers each holds (see kv_window);
    a q8_0 K or V counts its int8 values and fp16 scales (34 bytes per 32 values)."""
    window = kv_window(specs)
    full = sliding = 0
    for spec in specs:
        if isinstance(spec, KVSpec):
            if spec.values_in_keys:  # MLA: one row per token (latent and rotary key), values read from it
                size = block_size * spec.num_kv_heads * bytes_per_row(kv_types.k, spec.head_dim, dtype)
            else:
                size = block_size * spec.num_kv_heads * kv_types.bytes_per_token_head(spec.head_dim, dtype)
            if in_window_group(spec, window):
                sliding += size
            else:
                full += size
    return full, sliding


class ModelRunner:
    def __init__(self, model: nn.Module, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, ops: KernelBackend, seed: int = 0,
                 drafter: DraftRunner | MTPRunner | None = None, num_state_slots: int = 0,
                 num_window_blocks: int = 0,
                 kv_types: KVCacheTypes = KVCacheTypes(), pooler: Pooler | None = None,
                 encoder_cache: EncoderCache | None = None) -> None:
        self.model = model
        self.encoder_cache = encoder_cache  # a vision model's tower outputs by image hash (multimodal/)
        self.pooler = pooler  # pooling models (and --embeddings): pooled rows -> vectors or scores
        self.drafter = drafter  # draft-model or MTP speculation: proposes drafts before the target's forward
        self.config = config
        self.block_size = block_size
        self.device = device
        self.kv_caches = []  # per stateful mixer: (K, V) block tensors or a recurrent state's tensors
        self.cache_specs = model.cache_specs()  # per stateful mixer: what the runner allocates
        # Sliding layers keep K/V in their own blocks when the engine gives them some (else one group).
        window = kv_window(self.cache_specs) if num_window_blocks else 0
        self.in_window_group = [in_window_group(spec, window) for spec in self.cache_specs]
        self.has_window_group = any(self.in_window_group)
        for spec, windowed in zip(self.cache_specs, self.in_window_group):
            if isinstance(spec, KVSpec):
                self.kv_caches.append(_kv_tensors(num_window_blocks if windowed else num_blocks, block_size, spec,
                                                  dtype, device, windowed, kv_types))
            else:  # zeros: a fresh sequence's state is reset by the kernel, but snapshots are read as kept
                self.kv_caches.append(tuple(torch.zeros((max(num_state_slots, 1), *shape), dtype=torch.float32,
                                                        device=device) for shape in spec.shapes))
        self.sampler = Sampler(config.vocab_size, device, ops, seed)

    def execute(self, plan: SchedulerOutput, masks: MaskJob | None = None) -> ModelRunnerOutput:
        """One forward; `masks` (constrained rows' grammar masks, computed meanwhile) are applied before sampling."""
        self.sampler.forget(plan.finished_request_ids)
        if self.drafter is not None:
            self.drafter.forget(plan.finished_request_ids)
        self.copy_blocks(plan.block_copies, plan.window_block_copies)
        self.copy_states(plan.state_copies)
        if plan.is_empty:
            return ModelRunnerOutput()
        out = ModelRunnerOutput()
        proposals = self._propose(plan)
        if proposals:
            plan = replace(plan, chunks=[_with_drafts(c, proposals.get(c.request_id)) for c in plan.chunks])
            out.proposed_token_ids = {rid: p.token_ids for rid, p in proposals.items()}
        logits, inputs = self.forward(plan, out)
        if not inputs.sample_chunk_indices:
            return out
        # Sampled rows with draft-model drafts are verified by rejection sampling; every other row
        # (greedy drafts included: their verified tokens are plain argmaxes) goes through the sampler.
        rejected_by_chunk = {i for i in set(inputs.sample_chunk_indices)
                             if (p := proposals.get(plan.chunks[i].request_id)) is not None and p.probs is not None}
        plain = [j for j, i in enumerate(inputs.sample_chunk_indices) if i not in rejected_by_chunk]
        if plain:
            # All rows (the usual case): the logits as they are; a list index would copy them (16 rows of a
            # 262k vocabulary: 16 MB, ~4 % of a Gemma 3 270M C=16 step on 2 AVX2 cores, measured).
            rows = logits if len(plain) == logits.shape[0] else logits[plain]
            self._sample_plain(plan, rows, [inputs.sample_chunk_indices[j] for j in plain], out, masks)
        for i in sorted(rejected_by_chunk):
            rows = [j for j, c in enumerate(inputs.sample_chunk_indices) if c == i]
            self._verify_sampled(plan.chunks[i], logits[rows], proposals[plan.chunks[i].request_id], out)
        return out

    def forward(self, plan: SchedulerOutput,
                out: ModelRunnerOutput | None = None) -> tuple[torch.Tensor | None, ForwardInputs]:
        """One forward over the plan: logits (R, V) of the rows that sample, and the inputs built for it; pooling
        chunks' vectors go into `out.pooled`."""
        inputs = self.prepare_inputs(plan)
        if self.drafter is not None and self.drafter.wants_hidden and not inputs.pool_spans:
            return self._forward_recording(plan, inputs), inputs
        if not inputs.pool_spans:
            logits = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                                inputs.logits_indices, **inputs.model_kwargs())
            return logits, inputs
        # One pass gives the sampled rows' and the pooled rows' final hidden states; only the former meet the head.
        num_sampled = inputs.logits_indices.shape[0]
        pooled_rows = torch.cat([torch.arange(first, first + n) for _, first, n in inputs.pool_spans])
        # (token types only where some text has them: only the encoders that read them take the argument)
        types = {} if inputs.token_types is None else {"token_types": inputs.token_types}
        hidden = self.model.hidden_states(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                                          torch.cat([inputs.logits_indices, pooled_rows.to(self.device)]), **types)
        logits = self.model.compute_logits(hidden[:num_sampled]) if num_sampled else None
        at = num_sampled
        for chunk_index, _, n in inputs.pool_spans:
            chunk = plan.chunks[chunk_index]
            result = self._pool(hidden[at:at + n])
            if out is not None:
                out.pooled[chunk.request_id] = result.tolist()
            at += n
        return logits, inputs

    def _forward_recording(self, plan: SchedulerOutput, inputs: ForwardInputs) -> torch.Tensor | None:
        """MTP / EAGLE3 drafting: one pass gives the sampled rows' final hidden states (-> logits) and every row's
        (EAGLE3: its streams into the drafter's layers), which the drafter keeps as its input; rows are normed one
        by one, so the logits are the plain forward's."""
        num_sampled, num_tokens = inputs.logits_indices.shape[0], inputs.input_ids.shape[0]
        if self.drafter.aux_layers:  # EAGLE3: every row's stream into those layers, the final norm where sampled
            hidden, aux = self.model.aux_hidden_states(inputs.input_ids, inputs.positions, self.kv_caches,
                                                       inputs.meta, inputs.logits_indices, self.drafter.aux_layers,
                                                       **inputs.model_kwargs())
            self.drafter.record(plan.chunks, aux)
            return self.model.compute_logits(hidden) if num_sampled else None
        rows = torch.cat([inputs.logits_indices, torch.arange(num_tokens, device=self.device)])
        hidden = self.model.hidden_states(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, rows,
                                          **inputs.model_kwargs())
        self.drafter.record(plan.chunks, hidden[num_sampled:])
        return self.model.compute_logits(hidden[:num_sampled]) if num_sampled else None

    def _pool(self, rows: torch.Tensor) -> torch.Tensor:
        """One sequence's pooled rows -> its vector, or a reranker's one score."""
        config = self.pooler.config
        if config.score == "yes_no":  # Qwen3-Reranker: P(yes) against no, from the last row's logits
            yes, no = config.yes_no_token_ids
            logits = self.model.compute_logits(rows[-1:].clone())[0]
            return torch.sigmoid(logits[yes] - logits[no]).reshape(1)
        pooled = pool_rows(rows, config.pooling)
        if config.score == "classifier":  # cross-encoders: the model's head on the pooled row
            return torch.sigmoid(self.model.classify(pooled[None])[0, :1].float())
        return self.pooler(pooled)

    def _propose(self, plan: SchedulerOutput) -> dict[str, Proposal]:
        drafting = [c for c in plan.chunks if c.draft is not None and c.draft.num_tokens > 0]
        if self.drafter is None or not drafting:
            return {}
        return self.drafter.propose(drafting)

    def _sample_plain(self, plan: SchedulerOutput, logits: torch.Tensor, chunk_indices: list[int],
                      out: ModelRunnerOutput, masks: MaskJob | None = None) -> None:
        chunks = [plan.chunks[i] for i in chunk_indices]
        rows = [SamplingRow(c.request_id, c.sampling_params, c.prompt_token_ids, c.output_token_ids) for c in chunks]
        if masks is not None:
            masks.apply(logits, [c.request_id for c in chunks])
        tokens, logprobs = self.sampler.sample(logits, rows)
        for chunk, token, logprob in zip(chunks, tokens, logprobs):
            if chunk.num_draft_tokens:  # rows of one chunk are consecutive: the first is the next token
                out.verified_token_ids.setdefault(chunk.request_id, []).append(token)
                out.sampled_token_ids.setdefault(chunk.request_id, token)
                continue
            out.sampled_token_ids[chunk.request_id] = token
            if logprob is not None:
                out.logprobs[chunk.request_id] = logprob

    def _verify_sampled(self, chunk: ScheduledChunk, logits: torch.Tensor, proposal: Proposal,
                        out: ModelRunnerOutput) -> None:
        """logits (k+1, V) of a sampled row's verify chunk -> accepted drafts + one token (rejection sampling)."""
        row = SamplingRow(chunk.request_id, chunk.sampling_params)
        target = self.sampler.processed_probabilities(logits, [row] * logits.shape[0])  # (k+1, V)
        drafts = torch.tensor(proposal.token_ids, device=logits.device)[None, :]
        tokens, accepted = rejection_sample(target[None], proposal.probs[None].to(target.dtype), drafts,
                                            self.sampler.generator_for(row))
        emitted = tokens[0, :int(accepted[0]) + 1].tolist()
        out.verified_token_ids[chunk.request_id] = emitted
        out.sampled_token_ids[chunk.request_id] = emitted[0]

    def prepare_inputs(self, plan: SchedulerOutput) -> ForwardInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        token_seq: list[int] = []
        logits_indices: list[int] = []
        sample_chunks: list[int] = []
        max_blocks = max(len(c.block_table) for c in plan.chunks)
        tables = torch.zeros(len(plan.chunks), max_blocks, dtype=torch.int32)
        windowed = self.has_window_group
        window_slots: list[int] = []
        window_tables = [] if windowed else None
        pool_spans: list[tuple[int, int, int]] = []
        for i, chunk in enumerate(plan.chunks):
            n = len(chunk.token_ids)
            pos = range(chunk.start_position, chunk.start_position + n)
            if chunk.pool:  # the rows its pooling reads: all (mean), the first (CLS) or the last
                pool_spans.append(_pool_span(i, len(input_ids), n, self.pooler.config))
            table = chunk.block_table
            input_ids += chunk.token_ids
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
            if windowed:
                window_table = chunk.window_block_table
                window_slots += [window_table[p // bs] * bs + p % bs for p in pos]
                window_tables.append(window_table)
            token_seq += [i] * n
            tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
            if chunk.sample:  # the last known token's row, plus one row per draft token after it
                scored = chunk.num_draft_tokens + 1
                logits_indices += range(len(input_ids) - scored, len(input_ids))
                sample_chunks += [i] * scored
        dev = self.device
        pos_tensor = torch.tensor(positions, dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=tables.to(dev), token_seq=torch.tensor(token_seq, dtype=torch.int32, device=dev),
            token_pos=pos_tensor.to(dev),
            seq_lens=[c.start_position + len(c.token_ids) for c in plan.chunks],
            seq_token_counts=[len(c.token_ids) for c in plan.chunks],
            state=_state_metadata(plan, dev),
        )
        embeds = None
        if any(c.images for c in plan.chunks):
            embeds, meta.key_end = self._image_rows(plan, positions)
        if windowed:
            meta.window_view = replace(meta, slot_mapping=torch.tensor(window_slots, dtype=torch.long, device=dev),
                                       block_tables=_table_tensor(window_tables).to(dev))
        return ForwardInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev), positions=pos_tensor.long().to(dev),
            meta=meta, logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            sample_chunk_indices=sample_chunks, pool_spans=pool_spans, token_types=_token_types(plan, dev),
            embeds=embeds, rope_positions=_rope_positions(plan, dev),
        )

    def _image_rows(self, plan: SchedulerOutput,
                    positions: list[int]) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
        """The image rows of this forward: (row indices, the tower's embeddings for them), and each row's key_end
        where some image attends both ways (its run's end; everyone else's own position + 1)."""
        if self.encoder_cache is None:
            raise ValueError("a chunk with images reached a runner without a vision encoder")
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        key_end = None
        first_row = 0
        for chunk in plan.chunks:
            start, end = chunk.start_position, chunk.start_position + len(chunk.token_ids)
            for item in chunk.images:
                embeds = self.encoder_cache.get(item)
                picked = [(k, p) for k, p in enumerate(item.embed_positions()) if start <= p < end]
                rows += [first_row + p - start for _, p in picked]
                parts.append(embeds[[k for k, _ in picked]])
                for lo, hi in item.bidirectional_runs():
                    if hi > end and lo < end:  # the scheduler keeps a run's rest in one chunk
                        raise ValueError(f"a prefill chunk ends at {end}, inside an image run [{lo}, {hi})")
                    if key_end is None:
                        key_end = [p + 1 for p in positions]
                    for p in range(max(lo, start), min(hi, end)):
                        key_end[first_row + p - start] = hi
            first_row += len(chunk.token_ids)
        dev = self.device
        ends = torch.tensor(key_end, dtype=torch.int32, device=dev) if key_end is not None else None
        return (torch.tensor(rows, dtype=torch.long, device=dev), torch.cat(parts).to(dev)), ends

    def copy_blocks(self, copies: list[tuple[int, int]], window_copies: list[tuple[int, int]] = ()) -> None:
        """Copy-on-write: (src, dst) blocks of the full group, then of the sliding group (its own block ids)."""
        if self.drafter is not None:
            self.drafter.copy_blocks(copies)  # the draft model's K/V follows the full group's table
        for windowed, pairs in ((False, copies), (True, window_copies)):
            if not pairs:
                continue
            src = torch.tensor([s for s, _ in pairs], device=self.device)
            dst = torch.tensor([d for _, d in pairs], device=self.device)
            for caches, in_group in zip(self.kv_layer_tensors(), self.kv_layer_windowed()):
                if in_group == windowed:
                    for cache in caches:
                        cache[dst] = cache[src]

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Recurrent state slot to slot, in order (a prefix snapshot into a new sequence, a rollback)."""
        for src, dst in copies:
            for spec, cache in zip(self.cache_specs, self.kv_caches):
                if isinstance(spec, StateSpec):
                    for tensor in cache:
                        tensor[dst] = tensor[src]

    def state_layers(self) -> list[tuple[torch.Tensor, ...]]:
        """The state tensors of the recurrent mixers, (slots, ...) each."""
        return [cache for spec, cache in zip(self.cache_specs, self.kv_caches) if isinstance(spec, StateSpec)]

    def kv_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (K, V) block tensors of the attention layers (the block pool's bytes)."""
        return [cache for spec, cache in zip(self.cache_specs, self.kv_caches) if isinstance(spec, KVSpec)]

    def kv_layer_tensors(self) -> list[tuple[torch.Tensor, ...]]:
        """Each attention layer's distinct block tensors, to copy its bytes: (K, V), or an MLA layer's one
        latent tensor (kv_layers() lists it as both K and V)."""
        return [cache[:1] if cache[0] is cache[1] else cache for cache in self.kv_layers()]

    def kv_layer_windowed(self) -> list[bool]:
        """For each of kv_layers(): whether its blocks are the sliding group's (its own ids and table)."""
        return [w for spec, w in zip(self.cache_specs, self.in_window_group) if isinstance(spec, KVSpec)]


def _kv_tensors(num_blocks: int, block_size: int, spec: KVSpec, dtype: torch.dtype, device: torch.device,
                windowed: bool, kv_types: KVCacheTypes) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K and V block tensors (a q8_0 one: uint8 rows of Q8_0 blocks, kv_quant.py). The sliding group's
    have one more block, its NULL: zeros, never written, standing where a table's blocks were given back (the
    kernel never reads there; gathers see zeros, which dequantize to zeros)."""
    # empty, not zeros: a slot is always written before attention reads it, and untouched pages of
    # a large pool then cost no RAM until used.
    kinds = (kv_types.k,) if spec.values_in_keys else (kv_types.k, kv_types.v)
    caches = tuple(torch.empty((num_blocks + windowed, block_size, spec.num_kv_heads, row_width(kind, spec.head_dim)),
                               dtype=cache_dtype(kind, dtype), device=device) for kind in kinds)
    if spec.values_in_keys:  # MLA: (K, K), the values are the key rows' first columns (models/mla.py)
        caches = (caches[0], caches[0])
    if windowed:
        for cache in caches:
            cache[num_blocks].zero_()
    return caches


def _table_tensor(tables: list[tuple[int, ...]]) -> torch.Tensor:
    """(S, max_blocks) int32, each table zero-padded on the right."""
    out = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int32)
    for i, table in enumerate(tables):
        out[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
    return out


def _state_metadata(plan: SchedulerOutput, device: torch.device) -> StateMetadata | None:
    """Each sequence's state slot; a chunk from position 0 starts from a zero state."""
    if plan.chunks[0].state_slot is None:
        return None
    return StateMetadata.build([len(c.token_ids) for c in plan.chunks], [c.state_slot for c in plan.chunks],
                               [c.start_position == 0 for c in plan.chunks],
                               [sorted(c.state_snapshots) for c in plan.chunks], device=device)


def _token_types(plan: SchedulerOutput, device: torch.device) -> torch.Tensor | None:
    """(T,) int64 segments of every row, where some chunk carries them (others: type 0); else None."""
    if all(c.token_type_ids is None for c in plan.chunks):
        return None
    types = [t for c in plan.chunks for t in (c.token_type_ids or [0] * len(c.token_ids))]
    return torch.tensor(types, dtype=torch.long, device=device)


def _rope_positions(plan: SchedulerOutput, device: torch.device) -> torch.Tensor | None:
    """(3, T) int64 multimodal rotary positions where some chunk has them (others: their positions on every
    axis); rows past a chunk's list (drafts) continue its last position on every axis."""
    if all(c.rope_positions is None for c in plan.chunks):
        return None
    axes: list[list[int]] = [[], [], []]
    for chunk in plan.chunks:
        n = len(chunk.token_ids)
        given = chunk.rope_positions or ([], [], [])
        for axis, values in zip(axes, given):
            nxt = values[-1] + 1 if values else chunk.start_position
            axis += values[:n] + list(range(nxt, nxt + n - len(values[:n])))
    return torch.tensor(axes, dtype=torch.long, device=device)


def _pool_span(chunk_index: int, first_row: int, num_rows: int, config: PoolingConfig) -> tuple[int, int, int]:
    """(chunk index, first row, rows) a pooling chunk hands to the pooler."""
    if config.score == "yes_no" or config.pooling == "last":
        return chunk_index, first_row + num_rows - 1, 1
    if config.pooling == "cls":
        return chunk_index, first_row, 1
    return chunk_index, first_row, num_rows


def _with_drafts(chunk: ScheduledChunk, proposal: Proposal | None) -> ScheduledChunk:
    """The verify chunk: the row's token followed by the draft model's proposals; state snapshots planned for
    drafts it did not propose are dropped (they are never restored: update() only reads those of accepted ones)."""
    token_ids = chunk.token_ids + (proposal.token_ids if proposal is not None else [])
    snapshots = [(count, slot) for count, slot in chunk.state_snapshots if count <= len(token_ids)]
    if len(token_ids) == len(chunk.token_ids) and len(snapshots) == len(chunk.state_snapshots):
        return chunk
    return replace(chunk, token_ids=token_ids, state_snapshots=snapshots,
                   num_draft_tokens=chunk.num_draft_tokens + len(token_ids) - len(chunk.token_ids))
