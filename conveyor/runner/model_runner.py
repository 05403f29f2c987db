"""SchedulerOutput -> tensors -> one forward -> sampled tokens. Owns the KV cache tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from conveyor.engine.outputs import ModelRunnerOutput, SchedulerOutput
from conveyor.kernels import AttentionMetadata, KernelBackend
from conveyor.models.config import ModelConfig
from conveyor.runner.sampler import Sampler, SamplingRow


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # (R,) rows that sample
    sample_chunk_indices: list[int]  # chunk index of each sampled row (a chunk with drafts has several)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element


class ModelRunner:
    def __init__(self, model: nn.Module, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, ops: KernelBackend, seed: int = 0) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # empty, not zeros: a slot is always written before attention reads it, and untouched pages of
        # a large pool then cost no RAM until used.
        self.kv_caches = [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
                          for _ in range(config.num_hidden_layers)]
        self.sampler = Sampler(config.vocab_size, device, ops, seed)

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self.sampler.forget(plan.finished_request_ids)
        self._copy_blocks(plan.block_copies)
        if plan.is_empty:
            return ModelRunnerOutput()
        inputs = self.prepare_inputs(plan)
        logits = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, inputs.logits_indices)
        if not inputs.sample_chunk_indices:
            return ModelRunnerOutput()
        chunks = [plan.chunks[i] for i in inputs.sample_chunk_indices]
        rows = [SamplingRow(c.request_id, c.sampling_params, c.prompt_token_ids, c.output_token_ids) for c in chunks]
        tokens, logprobs = self.sampler.sample(logits, rows)
        out = ModelRunnerOutput()
        for chunk, token, logprob in zip(chunks, tokens, logprobs):
            if chunk.num_draft_tokens:  # rows of one chunk are consecutive: the first is the next token
                out.verified_token_ids.setdefault(chunk.request_id, []).append(token)
                out.sampled_token_ids.setdefault(chunk.request_id, token)
                continue
            out.sampled_token_ids[chunk.request_id] = token
            if logprob is not None:
                out.logprobs[chunk.request_id] = logprob
        return out

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
        for i, chunk in enumerate(plan.chunks):
            n = len(chunk.token_ids)
            pos = range(chunk.start_position, chunk.start_position + n)
            table = chunk.block_table
            input_ids += chunk.token_ids
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
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
        )
        return ForwardInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev), positions=pos_tensor.long().to(dev),
            meta=meta, logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            sample_chunk_indices=sample_chunks,
        )

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for key_cache, value_cache in self.kv_caches:
            key_cache[dst] = key_cache[src]
            value_cache[dst] = value_cache[src]
