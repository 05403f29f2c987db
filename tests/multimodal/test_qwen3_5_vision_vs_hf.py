"""Qwen3.5's processor (Qwen2-VL smart_resize / patchify, `<|image_pad|>` expansion, M-RoPE positions) and tower
against transformers (fp32)."""

from __future__ import annotations

import pytest
import torch
from tiny_qwen3_5_vision import (END, IMAGE, START, hf_config, hf_image_processor, hf_model, hf_tokenizer,
                                 processor_config, random_image)

from conveyor.errors import InvalidRequestError
from conveyor.multimodal.image_input import ImageInput
from conveyor.multimodal.qwen3_vl import QwenVisionEncoder, QwenVLProcessor, tower_prefix

transformers = pytest.importorskip("transformers")

SIZES = [(40, 50), (20, 30), (130, 33), (64, 64), (9, 61), (1, 1), (300, 200)]


class _Tokenizer:
    def __init__(self, tok) -> None:
        self.tok = tok

    def decode(self, ids, skip_special_tokens=False):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _ours() -> QwenVLProcessor:
    return QwenVLProcessor(hf_config(transformers).to_dict(), processor_config(), _Tokenizer(hf_tokenizer(transformers)))


def _image(w: int, h: int, seed: int) -> ImageInput:
    return ImageInput.from_pil(random_image(w, h, seed))


def test_pixels_match_the_image_processor():
    ours, theirs = _ours(), hf_image_processor(transformers)
    for i, (w, h) in enumerate(SIZES):
        image = _image(w, h, i)
        patches, gh, gw = ours.pixels(image)
        expected = theirs(images=[image.image], return_tensors="pt")
        assert expected["image_grid_thw"].tolist() == [[1, gh, gw]], (w, h)
        assert torch.equal(patches, expected["pixel_values"]), (w, h)


def test_expansion_and_rope_positions_match_get_rope_index():
    ours, model = _ours(), hf_model(transformers)
    images = [_image(40, 50, 1), _image(130, 33, 2)]
    prompt = [1, 40, START, IMAGE, END, 41, 42, START, IMAGE, END, 43, 2]
    expanded = ours.expand(prompt, images)
    grids = torch.tensor([[1, *ours.pixels(i)[1:]] for i in images])
    counts = (grids.prod(-1) // 4).tolist()
    expected = [1, 40, START] + [IMAGE] * counts[0] + [END, 41, 42, START] + [IMAGE] * counts[1] + [END, 43, 2]
    assert expanded.token_ids == expected
    assert [(it.offset, it.num_tokens) for it in expanded.items] == [(3, counts[0]), (7 + counts[0], counts[1])]
    ids = torch.tensor([expected])
    positions, delta = model.model.get_rope_index(ids, (ids == IMAGE).int(), image_grid_thw=grids)
    assert [list(p) for p in expanded.rope_positions] == positions[:, 0].tolist()
    assert expanded.rope_delta == int(delta)


def test_the_marker_text_is_the_templates_whole_image_part():
    tok = hf_tokenizer(transformers)
    marker = _ours().image_marker
    assert marker == "<|vision_start|><|image_pad|><|vision_end|>"
    assert tok.encode(marker, add_special_tokens=False) == [START, IMAGE, END]


def test_text_only_prompts_have_plain_positions():
    expanded = _ours().expand([1, 40, 41], [])
    assert expanded.rope_positions is None and expanded.token_ids == [1, 40, 41]


def test_marker_count_must_match_images():
    with pytest.raises(InvalidRequestError):
        _ours().expand([1, IMAGE, IMAGE], [_image(20, 20, 0)])


def test_processor_refuses_a_patch_size_other_than_the_towers():
    with pytest.raises(ValueError, match="patch_size"):
        QwenVLProcessor(hf_config(transformers).to_dict(), {**processor_config(), "patch_size": 14},
                        _Tokenizer(hf_tokenizer(transformers)))


def test_encoder_matches_get_image_features():
    model, ours = hf_model(transformers), _ours()
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    encoder = QwenVisionEncoder(hf_config(transformers).vision_config.to_dict())
    encoder.load_hf(weights, tower_prefix(weights))
    encoder.eval()
    for i, (w, h) in enumerate([(40, 50), (130, 33), (300, 200)]):
        item = ours.expand([IMAGE], [_image(w, h, i)]).items[0]
        grid = torch.tensor([[1, item.extras["grid_h"], item.extras["grid_w"]]])
        with torch.no_grad():
            expected = model.model.get_image_features(item.pixel_values, grid).pooler_output[0]
        got = encoder.encode(item)
        assert got.shape == (item.num_embeds, 64)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bf16_tower_on_the_kernels_is_close_and_repeatable():
    """The engine's tower: bf16 with the backend's dense attention: within bf16 rounding of the fp32 tower, and the
    same bits on every encode (the prefix cache keys on it)."""
    from conveyor.config import kernel_settings_from_env
    from conveyor.kernels import cpu_backend

    model, ours = hf_model(transformers), _ours()
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    vision = hf_config(transformers).vision_config.to_dict()
    fp32 = QwenVisionEncoder(vision)
    fp32.load_hf(weights, tower_prefix(weights))
    ops = cpu_backend(kernel_settings_from_env())
    bf16 = QwenVisionEncoder(vision, ops)
    bf16.load_hf(weights, tower_prefix(weights))
    bf16.to(torch.bfloat16).eval()
    assert all(block.ops is ops for block in bf16.blocks)
    item = ours.expand([IMAGE], [_image(61, 47, 5)]).items[0]
    got = bf16.encode(item)
    assert got.dtype == torch.bfloat16 and torch.equal(bf16.encode(item), got)
    want = fp32.encode(item)
    error, scale = (got.float() - want).abs(), want.abs().max()
    assert error.max() <= 0.1 * scale and error.mean() <= 0.01 * scale
