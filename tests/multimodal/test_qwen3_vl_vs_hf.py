"""Qwen3-VL against transformers (fp32): the tower with its DeepStack mergers == get_image_features (main rows and
every level), the expansion and M-RoPE positions == get_rope_index, prefill logits (image rows, DeepStack levels
added after the first decoder layers, interleaved M-RoPE) and greedy tokens past the prompt, 1 and 2 images."""

from __future__ import annotations

import pytest
import torch
from tiny_qwen3_vl import (DEEPSTACK, END, IMAGE, START, hf_config, hf_model, hf_tokenizer, processor_config,
                           random_image, write_model_dir)

from conveyor.multimodal.image_input import ImageInput
from conveyor.multimodal.qwen3_vl import QwenVisionEncoder, QwenVLProcessor, tower_prefix, vision_settings

transformers = pytest.importorskip("transformers")

PROMPTS = {1: [1, 40, START, IMAGE, END, 41, 42, 43],
           2: [1, 40, START, IMAGE, END, 41, START, IMAGE, END, 42, 43]}


class _Tokenizer:
    def __init__(self, tok) -> None:
        self.tok = tok

    def decode(self, ids, skip_special_tokens=False):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _processor() -> QwenVLProcessor:
    tokenizer = _Tokenizer(hf_tokenizer(transformers))
    return QwenVLProcessor(hf_config(transformers).to_dict(), processor_config(), tokenizer)


def test_tower_and_deepstack_mergers_match_get_image_features():
    model, ours = hf_model(transformers), _processor()
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    raw = hf_config(transformers).to_dict()
    encoder = QwenVisionEncoder(vision_settings(raw))
    encoder.load_hf(weights, tower_prefix(weights))
    encoder.eval()
    assert encoder.num_levels == len(DEEPSTACK)
    for i, (w, h) in enumerate([(40, 50), (130, 33)]):
        item = ours.expand([IMAGE], [ImageInput.from_pil(random_image(w, h, i))]).items[0]
        grid = torch.tensor([[1, item.extras["grid_h"], item.extras["grid_w"]]])
        with torch.no_grad():
            out = model.model.get_image_features(item.pixel_values, grid)
        expected = torch.cat([out.pooler_output[0], *(level[0] for level in out.deepstack_features)], dim=1)
        got = encoder.encode(item)
        assert got.shape == (item.num_embeds, 64 * (1 + len(DEEPSTACK)))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got[:, 64:128], got[:, 128:], atol=1e-2)  # the levels differ


def test_pixels_match_the_image_processor():
    """Qwen3-VL's processor is Qwen2-VL's image processor: patches and grids == Qwen2VLImageProcessorPil's."""
    from tiny_qwen3_vl import hf_image_processor

    ours, theirs = _processor(), hf_image_processor(transformers)
    for i, (w, h) in enumerate([(40, 50), (130, 33), (1, 1), (300, 200)]):
        image = ImageInput.from_pil(random_image(w, h, i))
        patches, gh, gw = ours.pixels(image)
        expected = theirs(images=[image.image], return_tensors="pt")
        assert expected["image_grid_thw"].tolist() == [[1, gh, gw]] and torch.equal(patches, expected["pixel_values"])


def test_defaults_are_qwen3_vls():
    """A config that leaves them out gets Qwen3-VL's image token and DeepStack blocks, not Qwen3.5's."""
    raw = {"model_type": "qwen3_vl", "vision_config": {}}
    assert vision_settings(raw)["deepstack_visual_indexes"] == (8, 16, 24)
    assert vision_settings({"model_type": "qwen3_5"})["deepstack_visual_indexes"] == ()


def test_expansion_and_rope_positions_match_get_rope_index():
    ours, model = _processor(), hf_model(transformers)
    images = [ImageInput.from_pil(random_image(40, 50, 1)), ImageInput.from_pil(random_image(130, 33, 2))]
    expanded = ours.expand(PROMPTS[2], images)
    ids = torch.tensor([expanded.token_ids])
    grids = torch.tensor([[1, it.extras["grid_h"], it.extras["grid_w"]] for it in expanded.items])
    positions, delta = model.model.get_rope_index(ids, (ids == IMAGE).int(), image_grid_thw=grids)
    assert [list(p) for p in expanded.rope_positions] == positions[:, 0].tolist()
    assert expanded.rope_delta == int(delta)


def test_bad_mrope_section_is_a_load_error():
    """Sections that do not cover half the rotary width fail at load (the text config, and build_vision for
    Qwen3.5's hybrid whose text family does not check), not at the first image prompt."""
    from tiny_qwen3_5_vision import hf_config as qwen3_5_config

    from conveyor.models.config import ModelConfig, ModelConfigError
    from conveyor.multimodal.qwen3_vl import check_mrope_section

    raw = hf_config(transformers).to_dict()
    check_mrope_section(raw)
    raw["text_config"]["rope_parameters"]["mrope_section"] = [4, 4, 4]
    with pytest.raises(ValueError, match="mrope_section"):
        check_mrope_section(raw)
    with pytest.raises(ModelConfigError, match="mrope_section"):
        ModelConfig.from_hf_dict(raw)
    hybrid = qwen3_5_config(transformers).to_dict()
    check_mrope_section(hybrid)  # head_dim 16, partial rotary 0.5: [2, 1, 1]
    hybrid["text_config"]["rope_parameters"]["mrope_section"] = [3, 3, 2]
    with pytest.raises(ValueError, match="qwen3_5: mrope_section"):
        check_mrope_section(hybrid)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conveyor.loading.hf_loader import load_hf_dir
    from conveyor.multimodal.vision import build_vision

    path = tmp_path_factory.mktemp("qwen3_vl")
    hf = write_model_dir(path, transformers)
    checkpoint = load_hf_dir(str(path))
    assert checkpoint.vision.model_type == "qwen3_vl" and checkpoint.config.architecture == "qwen3_vl_text"
    assert checkpoint.config.mrope_section == tuple(hf.config.text_config.rope_parameters["mrope_section"])
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


class _MainRows:
    def __init__(self, encoder) -> None:
        self.encoder = encoder

    def encode(self, item):
        return self.encoder.encode(item)[:, :64]


def _logits(runner, token_ids, expanded, start, table):
    from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
    from conveyor.engine.sampling_params import SamplingParams

    end = start + len(token_ids)
    n = len(expanded.token_ids)  # what Request.rope_positions_for hands the scheduler
    rope = tuple([*axis, *range(n + expanded.rope_delta, end + expanded.rope_delta)][start:end]
                 for axis in expanded.rope_positions)
    chunk = ScheduledChunk("r", token_ids, start, table, True, SamplingParams(temperature=0),
                           images=tuple(i for i in expanded.items if i.offset < end and i.end > start),
                           rope_positions=rope)
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
    # the DeepStack levels count: the main rows alone give other logits
    main_only = _runner(checkpoint, vision)
    main_only.encoder_cache.encoder = _MainRows(vision.encoder)
    assert not torch.allclose(_logits(main_only, got.token_ids, got, 0, table), expected, atol=1e-2)
    with torch.no_grad():  # plain positions give other logits too: the M-RoPE positions count
        plain = hf(**want, position_ids=torch.arange(ids.shape[1])[None]).logits[0]
        assert not torch.allclose(plain, expected, atol=1e-2)
        generated = hf.generate(**want, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    tokens, last = list(got.token_ids), ours[-1]
    for _ in range(6):
        tokens.append(int(last.argmax()))
        last = _logits(runner, tokens[-1:], got, len(tokens) - 1, table)[-1]
    assert tokens[len(got.token_ids):][:len(generated)] == generated  # generate stops at the eos (2)
