"""Comparing one of our models with transformers in float32: prefill logits, then greedy decode steps
continuing from our paged cache, each step's logits against transformers over the whole sequence."""

from __future__ import annotations

from typing import Mapping

import torch

from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.models.config import ModelConfig
from conveyor.models.registry import build_model
from conveyor.runner.model_runner import ModelRunner

BLOCK = 4


def float32_runner(config: ModelConfig, weights: Mapping) -> ModelRunner:
    model = build_model(config, weights, torch.float32, torch.device("cpu"), batch_invariant=False)
    return ModelRunner(model, config, num_blocks=32, block_size=BLOCK, dtype=torch.float32, device=torch.device("cpu"),
                       ops=model.ops)


def forward_all(runner: ModelRunner, tokens: list[int], start: int, table: list[int]) -> torch.Tensor:
    """Logits of every row of one chunk of request "r" (`tokens` from position `start`)."""
    chunk = ScheduledChunk("r", tokens, start, table, True, SamplingParams(temperature=0), state_slot=0)
    inputs = runner.prepare_inputs(SchedulerOutput(chunks=[chunk]))
    every_row = torch.arange(len(tokens))
    return runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, every_row)


def greedy_matches_transformers(runner: ModelRunner, hf, steps: int = 6) -> tuple[list[int], list[int]]:
    """Assert prefill and `steps` decode steps match `hf`; return (prompt, tokens so far)."""
    prompt = torch.randint(0, 128, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    table = [5, 2, 9, 7, 11, 3, 8]  # scattered blocks on purpose
    ours = forward_all(runner, prompt, 0, table)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
    tokens = list(prompt)
    for _ in range(steps):  # greedy decode steps continue from the paged cache
        nxt = int(ours[-1].argmax())
        ours = forward_all(runner, [nxt], len(tokens), table)
        tokens.append(nxt)
        with torch.no_grad():
            want = hf(torch.tensor([tokens])).logits[0, -1:]
        torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
    return prompt, tokens
