"""llama.cpp's qwen3vl_merger mmproj (as convert_hf_to_gguf.py --mmproj writes a Qwen3.5 tower) loads as the same
tower as the Hugging Face directory: bitwise the same rows (fp32); clip.cpp's pixel limits; refusals."""

from __future__ import annotations

import pytest
import torch
from tiny_qwen3_5_vision import IMAGE, PATCH, MERGE, random_image, write_mmproj, write_model_dir

from conveyor.loading.checkpoint import LoadError
from conveyor.multimodal.image_input import ImageInput

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from conveyor.loading.hf_loader import load_hf_dir

    path = tmp_path_factory.mktemp("qwen3_5_mmproj")
    hf = write_model_dir(path, transformers)
    write_mmproj(path / "mmproj.gguf", hf)
    return load_hf_dir(str(path)), str(path / "mmproj.gguf")


def test_mmproj_tower_equals_the_directorys(sources):
    from conveyor.loading.mmproj import read_mmproj
    from conveyor.multimodal.vision import build_vision

    checkpoint, mmproj = sources
    ours = read_mmproj(mmproj, checkpoint.tokenizer, checkpoint.config)
    assert ours.model_type == "qwen3_5" and ours.config["image_token_id"] == IMAGE
    cpu = torch.device("cpu")
    direct = build_vision(checkpoint.vision, checkpoint.tokenizer, torch.float32, cpu)
    loaded = build_vision(ours, checkpoint.tokenizer, torch.float32, cpu)
    area = (PATCH * MERGE) ** 2
    assert (loaded.processor.min_pixels, loaded.processor.max_pixels) == (8 * area, 4096 * area)
    for seed, (w, h) in enumerate([(40, 50), (130, 33)]):
        item = direct.processor.expand([IMAGE], [ImageInput.from_pil(random_image(w, h, seed))]).items[0]
        assert torch.equal(loaded.encoder.encode(item), direct.encoder.encode(item))


def test_a_deepstack_projector_is_refused(sources):
    from conveyor.loading.mmproj_qwen3vl import qwen3vl_checkpoint

    checkpoint, _ = sources
    meta = lambda key, default=None: [False, True] if key == "clip.vision.is_deepstack_layers" else default  # noqa
    with pytest.raises(LoadError, match="DeepStack"):
        qwen3vl_checkpoint(meta, {}, checkpoint.tokenizer, "x.gguf", "qwen3_5")


def test_mmproj_marker_is_wrapped(sources):
    from conveyor.loading.mmproj import read_mmproj
    from conveyor.multimodal.vision import build_vision

    checkpoint, mmproj = sources
    loaded = build_vision(read_mmproj(mmproj, checkpoint.tokenizer, checkpoint.config), checkpoint.tokenizer,
                          torch.float32, torch.device("cpu"))
    assert loaded.processor.image_marker == "<|vision_start|><|image_pad|><|vision_end|>"
