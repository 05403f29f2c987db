"""Qwen3.5 with images against transformers (fp32): prefill logits (image rows from our tower, interleaved M-RoPE
positions in the hybrid text model) and greedy tokens past the prompt (positions + rope_delta), 1 and 2 images."""

from __future__ import annotations

import pytest
import torch
from tiny_qwen3_5_vision import END, IMAGE, START, random_image, write_model_dir

from conveyor.multimodal.image_input import ImageInput

transformers = pytest.importorskip("transformers")

PROMPTS = {1: [1, 40, START, IMAGE, END, 41, 42, 43],
           2: [1, 40, START, IMAGE, END, 41, START, IMAGE, END, 42, 43]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conveyor.loading.hf_loader import load_hf_dir
    from conveyor.multimodal.vision import build_vision

    path = tmp_path_factory.mktemp("qwen3_5")
    hf = write_model_dir(path, transformers)
    checkpoint = load_hf_dir(str(path))
    assert checkpoint.vision.model_type == "qwen3_5"
    vision = build_vision(checkpoint.vision, checkpoint.tokenizer, torch.float32, torch.device("cpu"))
    return hf, checkpoint, vision


def _runner(checkpoint, vision):
    from conveyor.models.registry import build_model
    from conveyor.multimodal.encoder_cache import EncoderCache
    from conveyor.runner.model_runner import ModelRunner

    model = build_model(checkpoint.config, checkpoint.weights, torch.float32, torch.device("cpu"),
                        batch_invariant=False)
    return ModelRunner(model, checkpoint.config, num_blocks=256, block_size=4, dtype=torch.float32,
                       device=torch.device("cpu"), ops=model.ops, encoder_cache=EncoderCache(vision.encoder))


def _logits(runner, token_ids, expanded, start, table):
    from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
    from conveyor.engine.sampling_params import SamplingParams

    end = start + len(token_ids)
    rope = None
    if expanded.rope_positions is not None:  # what Request.rope_positions_for hands the scheduler
        n = len(expanded.token_ids)
        rope = tuple([*axis, *range(n + expanded.rope_delta, end + expanded.rope_delta)][start:end]
                     for axis in expanded.rope_positions)
    chunk = ScheduledChunk("r", token_ids, start, table, True, SamplingParams(temperature=0),
                           images=tuple(i for i in expanded.items if i.offset < end and i.end > start),
                           rope_positions=rope, state_slot=0)
    inputs = runner.prepare_inputs(SchedulerOutput(chunks=[chunk]))
    return runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta,
                        torch.arange(len(token_ids)), **inputs.model_kwargs())


@pytest.mark.parametrize("num_images", [1, 2])
def test_prefill_logits_and_greedy_match_transformers(tiny, num_images):
    hf, checkpoint, vision = tiny
    images = [random_image(40 + 19 * s, 30 + 7 * s, 10 + s) for s in range(num_images)]
    got = vision.processor.expand(PROMPTS[num_images], [ImageInput.from_pil(i) for i in images])
    ids = torch.tensor([got.token_ids])
    pixels = torch.cat([item.pixel_values for item in got.items])
    grid = torch.tensor([[1, item.extras["grid_h"], item.extras["grid_w"]] for item in got.items])
    want = dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).int())
    runner = _runner(checkpoint, vision)
    table = list(range(250, 0, -1))  # scattered blocks
    ours = _logits(runner, got.token_ids, got, 0, table)
    with torch.no_grad():
        expected = hf(**want).logits[0]
    assert expected.abs().max() > 2  # not a flat distribution
    torch.testing.assert_close(ours, expected, atol=1e-3, rtol=1e-4)
    with torch.no_grad():  # plain positions would give other logits: the M-RoPE positions count
        plain = hf(**want, position_ids=torch.arange(ids.shape[1])[None]).logits[0]
        assert not torch.allclose(plain, expected, atol=1e-2)
        generated = hf.generate(**want, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    tokens, last = list(got.token_ids), ours[-1]
    for _ in range(6):
        tokens.append(int(last.argmax()))
        last = _logits(runner, tokens[-1:], got, len(tokens) - 1, table)[-1]
    assert tokens[len(got.token_ids):][:len(generated)] == generated  # generate stops at the eos (2)
