"""Idefics3 / SmolVLM's processor and tower against transformers (fp32)."""

from __future__ import annotations

import pytest
import torch
from tiny_idefics3 import IMAGE, SEQ_LEN, hf_model, hf_processor, random_image, write_model_dir

from conveyor.multimodal.idefics3 import Idefics3Processor, Idefics3VisionEncoder
from conveyor.multimodal.image_input import ImageInput

transformers = pytest.importorskip("transformers")

SIZES = [(40, 50), (20, 30), (70, 33), (64, 64), (9, 61)]


def _ours(hf, split: bool) -> Idefics3Processor:
    config = hf_model_config()
    proc = hf.image_processor
    processor_config = {"size": dict(proc.size), "max_image_size": dict(proc.max_image_size),
                        "do_image_splitting": split, "image_seq_len": SEQ_LEN}
    return Idefics3Processor(config, processor_config, hf.tokenizer)


def hf_model_config() -> dict:
    return {"image_token_id": IMAGE, "scale_factor": 2, "text_config": {"hidden_size": 64},
            "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "image_size": 32, "patch_size": 8}}


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("sizes", [SIZES[:1], SIZES[1:3], SIZES[3:]])
def test_processor_matches_transformers(split, sizes):
    hf = hf_processor(transformers, split)
    ours = _ours(hf, split)
    text = "User:" + "".join(f"<image>pic {i}\n" for i in range(len(sizes))) + "ok?"
    images = [random_image(i, s) for i, s in enumerate(sizes)]
    want = hf(text=[text], images=[images], return_tensors="pt")
    prompt = hf.tokenizer.encode(text, add_special_tokens=False)
    got = ours.expand(prompt, [ImageInput.from_pil(im) for im in images])
    assert got.token_ids == want["input_ids"][0].tolist()
    frames = torch.cat([item.pixel_values for item in got.items])
    real = want["pixel_values"][0][: frames.shape[0]]
    assert torch.equal(frames, real)
    assert bool(want["pixel_attention_mask"][0][: frames.shape[0]].all())
    for item in got.items:  # every embed row is an <image> token, every <image> token of the span an embed row
        span = got.token_ids[item.offset:item.end]
        rows = [p - item.offset for p in item.embed_positions()]
        assert [i for i, t in enumerate(span) if t == IMAGE] == rows
        assert item.num_embeds == SEQ_LEN * item.pixel_values.shape[0]


def test_marker_count_must_match_images():
    from conveyor.errors import InvalidRequestError

    hf = hf_processor(transformers)
    with pytest.raises(InvalidRequestError):
        _ours(hf, True).expand(hf.tokenizer.encode("<image><image>", add_special_tokens=False),
                               [ImageInput.from_pil(random_image(0))])


@pytest.mark.parametrize("split", [True, False])
def test_encoder_matches_transformers(split):
    hf = hf_processor(transformers, split)
    model = hf_model(transformers)
    encoder = Idefics3VisionEncoder(model.config.to_dict())
    encoder.load(model.state_dict(), torch.float32)
    images = [random_image(3, (70, 33))]
    want = hf(text=["<image>"], images=[images], return_tensors="pt")
    with torch.no_grad():
        ref = model.model.get_image_features(want["pixel_values"], want["pixel_attention_mask"]).pooler_output[0]
    item = _ours(hf, split).expand([IMAGE], [ImageInput.from_pil(images[0])]).items[0]
    got = encoder.encode(item)
    assert got.shape == ref.shape == (item.num_embeds, 64)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


PROMPTS = {
    1: "<|im_start|>User:<image>What is this?<end_of_utterance>\nAssistant:",
    2: "<|im_start|>User: abc<image><image>\nCompare them.<end_of_utterance>\nAssistant:",
}


@pytest.fixture(scope="module", params=[True, False], ids=["split", "whole"])
def tiny(request, tmp_path_factory):
    from conveyor.loading.hf_loader import load_hf_dir
    from conveyor.multimodal.vision import build_vision

    path = tmp_path_factory.mktemp("idefics3")
    hf = write_model_dir(path, transformers, split=request.param)
    checkpoint = load_hf_dir(str(path))
    vision = build_vision(checkpoint.vision, checkpoint.tokenizer, torch.float32, torch.device("cpu"))
    return hf, checkpoint, vision, request.param


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
    hf, checkpoint, vision, split = tiny
    images = [random_image(10 + s, (50 + 9 * s, 40)) for s in range(num_images)]
    want = hf_processor(transformers, split)(text=[PROMPTS[num_images]], images=[images], return_tensors="pt")
    ids = checkpoint.tokenizer.encode(PROMPTS[num_images], add_special_tokens=False)
    got = vision.processor.expand(ids, [ImageInput.from_pil(i) for i in images])
    assert got.token_ids == want["input_ids"][0].tolist()
    runner = _runner(checkpoint, vision)
    table = list(range(250, 0, -1))  # scattered blocks
    ours = _logits(runner, got.token_ids, got.items, 0, table)
    with torch.no_grad():
        expected = hf(**want).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        generated = hf.generate(**want, max_new_tokens=6, do_sample=False)[0, len(got.token_ids):].tolist()
    tokens, last = list(got.token_ids), ours[-1]
    for _ in range(6):
        tokens.append(int(last.argmax()))
        last = _logits(runner, tokens[-1:], got.items, len(tokens) - 1, table)[-1]
    assert tokens[len(got.token_ids):][:len(generated)] == generated  # generate stops at the eos (2)


@pytest.mark.parametrize("split", [True, False])
def test_smolvlm_image_processor_pixels(split):
    """SmolVLM's image processor gives the frames and grid Idefics3's does (its text processor, the same strings,
    needs num2words and a video processor: not installed)."""
    images = transformers.SmolVLMImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                                   do_image_splitting=split)
    ours = _ours(hf_processor(transformers, split), split)
    for size in SIZES:
        image = random_image(1, size)
        want = images(images=[[image]], return_tensors="pt", return_row_col_info=True)
        item = ours.expand([IMAGE], [ImageInput.from_pil(image)]).items[0]
        assert torch.equal(want["pixel_values"][0], item.pixel_values)
        assert (want["rows"][0][0], want["cols"][0][0]) == (item.extras["rows"], item.extras["cols"])


def test_smolvlm_directory_matches_transformers(tmp_path):
    """A SmolVLMForConditionalGeneration directory (model_type smolvlm) loads: text as Llama, the same tower."""
    from conveyor.loading.hf_loader import load_hf_dir
    from conveyor.multimodal.vision import build_vision

    base = hf_model(transformers)
    config = transformers.SmolVLMConfig(text_config=base.config.text_config.to_dict(),
                                        vision_config=base.config.vision_config.to_dict(), scale_factor=2,
                                        image_token_id=IMAGE, pad_token_id=0)
    hf = transformers.SmolVLMForConditionalGeneration(config).eval()
    hf.load_state_dict(base.state_dict())
    hf.save_pretrained(tmp_path)
    processor = hf_processor(transformers)
    processor.save_pretrained(tmp_path)
    checkpoint = load_hf_dir(str(tmp_path))
    assert checkpoint.config.architecture == "llama" and checkpoint.vision.model_type == "smolvlm"
    vision = build_vision(checkpoint.vision, checkpoint.tokenizer, torch.float32, torch.device("cpu"))
    images = [random_image(5, (60, 41))]
    want = processor(text=[PROMPTS[1]], images=[images], return_tensors="pt")
    got = vision.processor.expand(checkpoint.tokenizer.encode(PROMPTS[1], add_special_tokens=False),
                                  [ImageInput.from_pil(i) for i in images])
    ours = _logits(_runner(checkpoint, vision), got.token_ids, got.items, 0, list(range(1, 251)))
    with torch.no_grad():
        expected = hf(**want).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
