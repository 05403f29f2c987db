"""Idefics3 / SmolVLM's processor and tower against transformers (fp32)."""

from __future__ import annotations

import pytest
import torch
from tiny_idefics3 import IMAGE, SEQ_LEN, hf_model, hf_processor, random_image

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
