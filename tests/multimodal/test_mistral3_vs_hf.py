"""Mistral 3's processor (Pixtral) and tower + projector against transformers (fp32)."""

from __future__ import annotations

import pytest
import torch
from tiny_mistral3 import BREAK, END, IMAGE, hf_config, hf_model, hf_processor, random_image, write_model_dir

from conveyor.multimodal.image_input import ImageInput
from conveyor.multimodal.pixtral import Mistral3VisionEncoder, PixtralProcessor

transformers = pytest.importorskip("transformers")

SIZES = [(40, 50), (20, 30), (130, 33), (64, 64), (9, 61), (1, 1), (300, 200)]


def _ours(hf, kind: str = "mistral3") -> PixtralProcessor:
    proc = hf.image_processor
    processor_config = {"size": dict(proc.size), "patch_size": hf.patch_size,
                        "spatial_merge_size": hf.spatial_merge_size, "image_mean": proc.image_mean,
                        "image_std": proc.image_std}
    return PixtralProcessor(hf_config(transformers, kind=kind).to_dict(), processor_config, _Tokenizer(hf.tokenizer))


class _Tokenizer:
    """transformers' tokenizer under the two calls the processor makes of ours."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def decode(self, ids, skip_special_tokens=False):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token):
        return self.tok.convert_tokens_to_ids(token)


@pytest.mark.parametrize("kind", ["mistral3", "llava"])
@pytest.mark.parametrize("sizes", [SIZES[:1], SIZES[1:3], SIZES[3:6], SIZES[6:]])
def test_processor_matches_transformers(sizes, kind):
    hf = hf_processor(transformers, 2 if kind == "mistral3" else 1)
    ours = _ours(hf, kind)
    text = "[INST]" + "".join(f"[IMG]pic {i}\n" for i in range(len(sizes))) + "ok?[/INST]"
    images = [random_image(i, s) for i, s in enumerate(sizes)]
    want = hf(text=[text], images=[images], return_tensors="pt")
    prompt = hf.tokenizer.encode(text, add_special_tokens=False)
    got = ours.expand(prompt, [ImageInput.from_pil(im) for im in images])
    assert got.token_ids == want["input_ids"][0].tolist()
    assert len(got.items) == len(images)
    for i, item in enumerate(got.items):
        height, width = want["image_sizes"][i].tolist()
        assert item.pixel_values.shape == (3, height, width)
        assert torch.equal(item.pixel_values, want["pixel_values"][i][:, :height, :width])
        span = got.token_ids[item.offset:item.end]
        rows = [p - item.offset for p in item.embed_positions()]
        assert [j for j, t in enumerate(span) if t == IMAGE] == rows  # every [IMG] an embed row, in order
        assert span[-1] == END and span.count(BREAK) == item.extras["rows"] - 1
        assert item.num_embeds == item.extras["rows"] * item.extras["cols"]
        assert len(item.embed_runs) == item.extras["rows"]


def test_a_sliver_image_gets_one_row():
    """2000 x 1 px fits the longest edge at 64 x 0 px, which transformers fails on: here one row of units."""
    item = _ours(hf_processor(transformers)).expand([IMAGE], [ImageInput.from_pil(random_image(0, (2000, 1)))])
    assert item.items[0].pixel_values.shape == (3, 16, 64) and item.items[0].extras == {"rows": 1, "cols": 4}


def test_marker_count_must_match_images():
    from conveyor.errors import InvalidRequestError

    hf = hf_processor(transformers)
    with pytest.raises(InvalidRequestError):
        _ours(hf).expand([IMAGE, IMAGE], [ImageInput.from_pil(random_image(0))])


def test_processor_refuses_a_patch_size_other_than_the_towers():
    hf = hf_processor(transformers)
    with pytest.raises(ValueError, match="patch x merge"):
        PixtralProcessor(hf_config(transformers).to_dict(), {"patch_size": 16, "spatial_merge_size": 2},
                         _Tokenizer(hf.tokenizer))


@pytest.mark.parametrize("kind, bias, layer", [("mistral3", False, -1), ("mistral3", True, -2), ("llava", True, -1),
                                               ("llava", True, -2)])
def test_encoder_matches_get_image_features(kind, bias, layer):
    """Mistral 3 with and without projector biases, Pixtral 12B's Llava (no norm, no merger); the last layer's
    features and the one before (vision_feature_layer)."""
    hf = hf_processor(transformers, 2 if kind == "mistral3" else 1)
    model = hf_model(transformers, bias=bias, kind=kind, feature_layer=layer)
    encoder = Mistral3VisionEncoder(model.config.to_dict())
    encoder.load(model.state_dict(), torch.float32)
    images = [random_image(3, (70, 33)), random_image(4, (64, 40))]
    want = hf(text=["[IMG][IMG]"], images=[images], return_tensors="pt")
    with torch.no_grad():
        ref = model.model.get_image_features(pixel_values=want["pixel_values"],
                                             image_sizes=want["image_sizes"]).pooler_output
    items = _ours(hf, kind).expand([IMAGE, IMAGE], [ImageInput.from_pil(im) for im in images]).items
    for item, expected in zip(items, ref):
        got = encoder.encode(item)
        assert got.shape == expected.shape == (item.num_embeds, 64)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


PROMPTS = {
    1: "<s>[INST][IMG]What is this?[/INST]",
    2: "<s>[INST]abc[IMG][IMG]\nCompare them.[/INST]",
}


@pytest.fixture(scope="module", params=[("mistral3", "mistral"), ("mistral3", "ministral3"), ("llava", "mistral")],
                ids=["mistral3-mistral", "mistral3-ministral3", "llava-mistral"])
def tiny(request, tmp_path_factory):
    from conveyor.loading.hf_loader import load_hf_dir
    from conveyor.multimodal.vision import build_vision

    kind, text = request.param
    path = tmp_path_factory.mktemp("mistral3")
    hf = write_model_dir(path, transformers, text=text, kind=kind)
    checkpoint = load_hf_dir(str(path))
    assert checkpoint.config.architecture == "ministral3" and checkpoint.vision.model_type == kind
    vision = build_vision(checkpoint.vision, checkpoint.tokenizer, torch.float32, torch.device("cpu"))
    return hf, checkpoint, vision, kind


def _runner(checkpoint, vision):
    from conveyor.models.registry import build_model
    from conveyor.multimodal.encoder_cache import EncoderCache
    from conveyor.runner.model_runner import ModelRunner

    model = build_model(checkpoint.config, checkpoint.weights, torch.float32, torch.device("cpu"),
                        batch_invariant=False)
    return ModelRunner(model, checkpoint.config, num_blocks=256, block_size=4, dtype=torch.float32,
                       device=torch.device("cpu"), ops=model.ops, encoder_cache=EncoderCache(vision.encoder))


def _logits(runner, token_ids, items, start, table):
    from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
    from conveyor.engine.sampling_params import SamplingParams

    end = start + len(token_ids)
    chunk = ScheduledChunk("r", token_ids, start, table, True, SamplingParams(temperature=0),
                           images=tuple(i for i in items if i.offset < end and i.end > start))
    inputs = runner.prepare_inputs(SchedulerOutput(chunks=[chunk]))
    return runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta,
                        torch.arange(len(token_ids)), **inputs.model_kwargs())


@pytest.mark.parametrize("num_images", [1, 2])
def test_prefill_logits_and_greedy_match_transformers(tiny, num_images):
    hf, checkpoint, vision, kind = tiny
    images = [random_image(10 + s, (50 + 19 * s, 40)) for s in range(num_images)]
    want = hf_processor(transformers, 2 if kind == "mistral3" else 1)(text=[PROMPTS[num_images]], images=[images],
                                                                     return_tensors="pt")
    ids = checkpoint.tokenizer.encode(PROMPTS[num_images], add_special_tokens=False)
    got = vision.processor.expand(ids, [ImageInput.from_pil(i) for i in images])
    assert got.token_ids == want["input_ids"][0].tolist()
    runner = _runner(checkpoint, vision)
    table = list(range(250, 0, -1))  # scattered blocks
    ours = _logits(runner, got.token_ids, got.items, 0, table)
    with torch.no_grad():
        expected = hf(**want).logits[0]
    assert expected.abs().max() > 10  # fan-in scaled weights: logits of tens, sharp attention
    torch.testing.assert_close(ours, expected, atol=1e-3, rtol=1e-4)
    with torch.no_grad():  # image tokens given plain token embeddings would give other logits
        assert not torch.allclose(hf(input_ids=want["input_ids"]).logits[0], expected, atol=1e-2)
        generated = hf.generate(**want, max_new_tokens=6, do_sample=False)[0, len(got.token_ids):].tolist()
    tokens, last = list(got.token_ids), ours[-1]
    for _ in range(6):
        tokens.append(int(last.argmax()))
        last = _logits(runner, tokens[-1:], got.items, len(tokens) - 1, table)[-1]
    assert tokens[len(got.token_ids):][:len(generated)] == generated  # generate stops at the eos (2)


def test_bf16_tower_on_the_kernels_is_close_and_repeatable(tiny, monkeypatch):
    """The engine's tower: bf16 with the backend's dense attention (the AMX kernel where it runs): within bf16
    rounding of the fp32 tower, and the same bits on every encode (the prefix cache keys on it)."""
    from conveyor.config import kernel_settings_from_env
    from conveyor.kernels import cpu_backend
    from conveyor.multimodal.vision import build_vision

    _, checkpoint, vision, _ = tiny
    ops = cpu_backend(kernel_settings_from_env())
    bf16 = build_vision(checkpoint.vision, checkpoint.tokenizer, torch.bfloat16, torch.device("cpu"), ops=ops)
    assert all(layer.ops is ops for layer in bf16.encoder.layers)
    item = vision.processor.expand([IMAGE], [ImageInput.from_pil(random_image(5, (61, 47)))]).items[0]
    got = bf16.encoder.encode(item)
    assert got.dtype == torch.bfloat16 and torch.equal(bf16.encoder.encode(item), got)
    from conveyor.multimodal import pixtral  # the shared GEMM output buffers change no bits

    monkeypatch.setattr(pixtral, "_mm", lambda x, weight, out: torch.nn.functional.linear(x, weight))
    assert torch.equal(bf16.encoder.encode(item), got)
    want = vision.encoder.encode(item)
    # (sharp attention in the tiny tower: plain torch in bf16 is as far off, e.g. Llava's max 0.38 of 6.3)
    error, scale = (got.float() - want).abs(), want.abs().max()
    assert error.max() <= 0.1 * scale and error.mean() <= 0.01 * scale


def test_llava_with_another_tower_is_refused():
    config = hf_config(transformers, kind="llava").to_dict()
    config["vision_config"]["model_type"] = "clip_vision_model"
    with pytest.raises(ValueError, match="clip_vision_model vision tower is not supported"):
        Mistral3VisionEncoder(config)
    config = hf_config(transformers, kind="llava").to_dict()
    config["vision_feature_select_strategy"] = "default"
    with pytest.raises(ValueError, match="select_strategy full"):
        Mistral3VisionEncoder(config)
