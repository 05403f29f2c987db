"""LFM2-VL against transformers (fp32): the processor's layout worked by hand from Lfm2VlImageProcessor's code (its
module needs torchvision, absent here) and its pixels against numpy / PIL; tower + projector == get_image_features;
prefill logits and greedy tokens == forward / generate with 1 and 2 images (split and not)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_lfm2_vl import (IMAGE, IMAGE_END, IMAGE_START, PROCESSOR, SPECIAL, THUMBNAIL, hf_inputs, hf_model,
                          random_image, write_model_dir)

from conveyor.multimodal.image_input import ImageInput
from conveyor.multimodal.lfm2_vl import Lfm2VlProcessor, Lfm2VlVisionEncoder

transformers = pytest.importorskip("transformers")


def _row(r: int, c: int) -> int:
    return SPECIAL.index(f"<|img_row_{r}_col_{c}|>")


def _ours(model) -> Lfm2VlProcessor:
    from tiny_lfm2_vl import hf_tokenizer

    return Lfm2VlProcessor(model.config.to_dict(), PROCESSOR, hf_tokenizer(transformers))


@pytest.fixture(scope="module")
def model():
    return hf_model(transformers)


# (width, height) -> (rows, cols, thumbnail / whole-image patch grid): worked by hand from smart_resize,
# _is_image_too_large and find_closest_aspect_ratio with 8 px units, 128..512 pixels, 16 px tiles, 2..4 tiles.
LAYOUTS = {
    (20, 30): (1, 1, (8, 4)),  # rounds to 32 x 16 = 512: inside the budget, one frame of 8 tokens
    (10, 10): (1, 1, (4, 4)),  # rounds to 8 x 8 = 64 < 128: scaled up to 16 x 16
    (50, 40): (2, 2, (4, 6)),  # 40 x 48 = 1920 > 1024: 2 x 2 (aspect 1.25 closest to 1), thumbnail 16 x 24
    (70, 20): (1, 4, (2, 10)),  # 16 x 72 = 1152 > 1024: 3 x 1 and 4 x 1 tie at 3.5, the larger covers half: 4 x 1
}


@pytest.mark.parametrize("size", list(LAYOUTS))
def test_layout_and_tokens_worked_by_hand(model, size):
    rows, cols, (th, tw) = LAYOUTS[size]
    ours = _ours(model)
    got = ours.expand([1, IMAGE, 40], [ImageInput.from_pil(random_image(*size))])
    item = got.items[0]
    want = [IMAGE_START]
    if rows * cols > 1:
        for r in range(rows):
            for c in range(cols):
                want += [_row(r + 1, c + 1)] + [IMAGE] * 4
        want += [THUMBNAIL]
    want += [IMAGE] * (th // 2 * tw // 2) + [IMAGE_END]
    assert got.token_ids == [1] + want + [40]
    assert (item.offset, item.num_tokens) == (1, len(want))
    assert item.extras["shapes"] == [(4, 4)] * (rows * cols if rows * cols > 1 else 0) + [(th, tw)]
    assert [p - item.offset for p in item.embed_positions()] == [i for i, t in enumerate(want) if t == IMAGE]
    assert item.pixel_values.shape == (sum(h * w for h, w in item.extras["shapes"]), 4 * 4 * 3)


LAYOUT_KEYS = ("downsample_factor", "min_tiles", "max_tiles", "min_image_tokens", "max_image_tokens",
               "encoder_patch_size", "tile_size", "max_pixels_tolerance")


def _oracle_tokens(images, text, settings: dict, height: int, width: int) -> tuple[str, tuple[int, int, int, int]]:
    """transformers' layout code: the image's token string and (rows, cols, resized h, resized w)."""
    kwargs = {k: settings[k] for k in LAYOUT_KEYS}
    _, rows, cols, new_h, new_w = images._get_split_layout(height, width, **kwargs)
    patch, factor = settings["encoder_patch_size"], settings["downsample_factor"]
    per_tile = text._compute_tokens_per_tile(settings["tile_size"], patch, factor)
    whole = text._compute_tokens_for_image([new_h, new_w], patch, factor)
    return text._build_image_tokens(rows, cols, per_tile, whole, settings["use_thumbnail"], True), (rows, cols, new_h,
                                                                                                    new_w)


def test_layout_and_tokens_match_transformers_code(model):
    """Our layout and token runs == transformers' own layout methods (run without torchvision, which only its resize
    needs) for 60 sizes with the tiny settings (through expand) and 400 with LFM2-VL's real ones (the layout)."""
    from tiny_lfm2_vl import hf_tokenizer, transformers_layout_code

    from conveyor.multimodal.lfm2_vl import PROCESSOR_DEFAULTS

    images, text = transformers_layout_code()
    tok = hf_tokenizer(transformers)
    ours = _ours(model)
    rng = np.random.default_rng(0)
    for width, height in rng.integers(1, 120, (60, 2)).tolist():
        want, _ = _oracle_tokens(images, text, PROCESSOR, height, width)
        got = ours.expand([IMAGE], [ImageInput.from_pil(random_image(width, height))])
        assert got.token_ids == tok.encode(want, add_special_tokens=False), (width, height)
    real = Lfm2VlProcessor({"image_token_id": IMAGE, "vision_config": {"patch_size": 16}}, {}, tok)
    for width, height in rng.integers(1, 4000, (400, 2)).tolist():
        _, layout = _oracle_tokens(images, text, PROCESSOR_DEFAULTS, height, width)
        assert real.layout(height, width) == layout, (width, height)


def test_without_thumbnail_or_special_tokens(model):
    from tiny_lfm2_vl import hf_tokenizer

    raw, tok = model.config.to_dict(), hf_tokenizer(transformers)
    image = [ImageInput.from_pil(random_image(50, 40))]
    bare = Lfm2VlProcessor(raw, dict(PROCESSOR, use_thumbnail=False), tok).expand([IMAGE], image)
    assert bare.token_ids == [IMAGE_START] + sum(([_row(r, c)] + [IMAGE] * 4 for r in (1, 2) for c in (1, 2)), []) + [
        IMAGE_END]
    assert bare.items[0].extras["shapes"] == [(4, 4)] * 4
    plain = Lfm2VlProcessor(raw, dict(PROCESSOR, use_image_special_tokens=False), tok).expand([IMAGE], image)
    assert plain.token_ids == [IMAGE] * (4 * 4 + 6)
    whole = Lfm2VlProcessor(raw, dict(PROCESSOR, do_image_splitting=False), tok).expand([IMAGE], image)
    assert whole.token_ids == [IMAGE_START] + [IMAGE] * 6 + [IMAGE_END]  # the smart-resized 16 x 24 alone


def test_pixels_numpy_and_pil(model):
    """An image already of its smart size is not resized: its patches are (x / 255 - 0.5) / 0.5 in (row, col,
    channel) order; a resized frame is the bilinear antialiased image (PIL's within 1 level); tiles are crops of
    one resize of the whole grid."""
    ours = _ours(model)
    image = random_image(16, 32, seed=5)
    item = ours.expand([IMAGE], [ImageInput.from_pil(image)]).items[0]
    x = (np.asarray(image).astype(np.float32) - np.float32(127.5)) / np.float32(127.5)  # (32, 16, 3)
    patches = x.reshape(8, 4, 4, 4, 3).transpose(0, 2, 1, 3, 4).reshape(32, 48)
    np.testing.assert_allclose(item.pixel_values.numpy(), patches, rtol=0, atol=1e-6)

    image = random_image(50, 40, seed=6)
    frames, rows, cols, size = ours.frames(ImageInput.from_pil(image))
    assert (rows, cols, size) == (2, 2, (16, 24))
    pil_grid = np.asarray(image.resize((32, 32), Image.Resampling.BILINEAR)).astype(int)
    for i, tile in enumerate(frames[:4]):
        r, c = divmod(i, 2)
        assert np.abs(tile.permute(1, 2, 0).numpy().astype(int) - pil_grid[16 * r:16 * r + 16, 16 * c:16 * c + 16]
                      ).max() <= 1
    pil_thumb = np.asarray(image.resize((24, 16), Image.Resampling.BILINEAR)).astype(int)
    assert np.abs(frames[4].permute(1, 2, 0).numpy().astype(int) - pil_thumb).max() <= 1


def test_marker_count_must_match_images(model):
    from conveyor.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        _ours(model).expand([IMAGE, IMAGE], [ImageInput.from_pil(random_image(20, 30))])


@pytest.mark.parametrize("use_layernorm", [True, False])
def test_encoder_matches_transformers(use_layernorm):
    hf = hf_model(transformers, seed=1, use_layernorm=use_layernorm)
    encoder = Lfm2VlVisionEncoder(hf.config.to_dict())
    encoder.load(hf.state_dict(), torch.float32)
    items = _ours(hf).expand([IMAGE, IMAGE], [ImageInput.from_pil(random_image(50, 40, 1)),
                                              ImageInput.from_pil(random_image(20, 30, 2))]).items
    with torch.no_grad():
        ref = torch.cat(hf.model.get_image_features(**hf_inputs(items)).pooler_output)
    got = torch.cat([encoder.encode(item) for item in items])
    assert got.shape == ref.shape == (sum(item.num_embeds for item in items), 64)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


PROMPTS = {1: [1, 40, IMAGE, 41, 42, 43], 2: [1, 40, IMAGE, 41, IMAGE, 42, 43]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conveyor.loading.hf_loader import load_hf_dir
    from conveyor.multimodal.vision import build_vision

    path = tmp_path_factory.mktemp("lfm2_vl")
    hf = write_model_dir(path, transformers)
    checkpoint = load_hf_dir(str(path))
    assert checkpoint.vision.model_type == "lfm2_vl"
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
    chunk = ScheduledChunk("r", token_ids, start, table, True, SamplingParams(temperature=0),
                           images=tuple(i for i in expanded.items if i.offset < end and i.end > start),
                           state_slot=0)
    inputs = runner.prepare_inputs(SchedulerOutput(chunks=[chunk]))
    return runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta,
                        torch.arange(len(token_ids)), **inputs.model_kwargs())


@pytest.mark.parametrize("num_images", [1, 2])
def test_prefill_logits_and_greedy_match_transformers(tiny, num_images):
    hf, checkpoint, vision = tiny
    images = [random_image(50, 40, 10), random_image(20, 30, 11)][:num_images]  # split, then whole
    got = vision.processor.expand(PROMPTS[num_images], [ImageInput.from_pil(i) for i in images])
    ids = torch.tensor([got.token_ids])
    want = dict(input_ids=ids, **hf_inputs(got.items))
    runner = _runner(checkpoint, vision)
    table = list(range(250, 0, -1))  # scattered blocks
    ours = _logits(runner, got.token_ids, got, 0, table)
    with torch.no_grad():
        expected = hf(**want).logits[0]
        other = hf(**dict(want, pixel_values=want["pixel_values"] + 0.5)).logits[0]
    assert expected.abs().max() > 2  # not a flat distribution
    assert not torch.allclose(other, expected, atol=1e-2)  # the image counts
    torch.testing.assert_close(ours, expected, atol=1e-3, rtol=1e-4)
    with torch.no_grad():
        generated = hf.generate(**want, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    tokens, last = list(got.token_ids), ours[-1]
    for _ in range(6):
        tokens.append(int(last.argmax()))
        last = _logits(runner, tokens[-1:], got, len(tokens) - 1, table)[-1]
    assert tokens[len(got.token_ids):][:len(generated)] == generated  # generate stops at the eos (2)


def test_bf16_tower_on_the_kernels_is_close_and_repeatable(tiny):
    """The engine's tower: bf16 with the backend's dense attention and GELU: within bf16 rounding of the fp32 tower,
    and the same bits on every encode (the prefix cache keys on it)."""
    from conveyor.config import kernel_settings_from_env
    from conveyor.kernels import cpu_backend
    from conveyor.multimodal.vision import build_vision

    _, checkpoint, vision = tiny
    ops = cpu_backend(kernel_settings_from_env())
    bf16 = build_vision(checkpoint.vision, checkpoint.tokenizer, torch.bfloat16, torch.device("cpu"), ops=ops)
    assert all(layer.ops is ops for layer in bf16.encoder.layers)
    item = vision.processor.expand([IMAGE], [ImageInput.from_pil(random_image(50, 40, 7))]).items[0]
    got = bf16.encoder.encode(item)
    assert got.dtype == torch.bfloat16 and torch.equal(bf16.encoder.encode(item), got)
    want = vision.encoder.encode(item)
    error, scale = (got.float() - want).abs(), want.abs().max()
    assert error.max() <= 0.1 * scale and error.mean() <= 0.01 * scale
