"""llama.cpp's qwen3vl_merger mmproj of a Qwen3-VL (DeepStack mergers as v.deepstack.{block}.*) loads as the same
tower as the Hugging Face directory: bitwise the same rows, every level (fp32); refusals."""

from __future__ import annotations

import pytest
import torch
from tiny_qwen3_vl import DEEPSTACK, IMAGE, random_image, write_mmproj, write_model_dir

from conveyor.loading.checkpoint import LoadError
from conveyor.multimodal.image_input import ImageInput

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from conveyor.loading.hf_loader import load_hf_dir

    path = tmp_path_factory.mktemp("qwen3_vl_mmproj")
    hf = write_model_dir(path, transformers)
    write_mmproj(path / "mmproj.gguf", hf)
    return load_hf_dir(str(path)), str(path / "mmproj.gguf")


@pytest.mark.parametrize("with_text", [True, False])
def test_mmproj_tower_equals_the_directorys(sources, with_text):
    from conveyor.loading.mmproj import read_mmproj
    from conveyor.multimodal.vision import build_vision

    checkpoint, mmproj = sources
    ours = read_mmproj(mmproj, checkpoint.tokenizer, checkpoint.config if with_text else None)
    assert ours.model_type == "qwen3_vl" and ours.config["vision_config"]["deepstack_visual_indexes"] == [0, 2]
    cpu = torch.device("cpu")
    direct = build_vision(checkpoint.vision, checkpoint.tokenizer, torch.float32, cpu)
    loaded = build_vision(ours, checkpoint.tokenizer, torch.float32, cpu)
    assert loaded.encoder.num_levels == len(DEEPSTACK)
    for seed, (w, h) in enumerate([(40, 50), (130, 33)]):
        item = direct.processor.expand([IMAGE], [ImageInput.from_pil(random_image(w, h, seed))]).items[0]
        assert torch.equal(loaded.encoder.encode(item), direct.encoder.encode(item))


def test_a_deepstack_projector_cannot_feed_a_qwen3_5_text_model(sources):
    from conveyor.loading.mmproj_qwen3vl import qwen3vl_checkpoint

    checkpoint, _ = sources
    meta = lambda key, default=None: [True, False] if key == "clip.vision.is_deepstack_layers" else default  # noqa
    with pytest.raises(LoadError, match="cannot feed a qwen3_5"):
        qwen3vl_checkpoint(meta, {}, checkpoint.tokenizer, "x.gguf", "qwen3_5")


def test_an_unflagged_deepstack_tensor_is_refused(sources):
    from conveyor.loading.mmproj_qwen3vl import qwen3vl_checkpoint

    checkpoint, _ = sources
    meta = lambda key, default=None: [True, False] if key == "clip.vision.is_deepstack_layers" else default  # noqa
    tensors = {"v.patch_embd.weight": torch.zeros(4, 3, 8, 8), "v.patch_embd.weight.1": torch.zeros(4, 3, 8, 8),
               "v.deepstack.1.fc1.weight": torch.zeros(1)}
    with pytest.raises(LoadError, match=r"unknown tensor v\.deepstack\.1\.fc1\.weight in a qwen3vl_merger"):
        qwen3vl_checkpoint(meta, tensors, checkpoint.tokenizer, "x.gguf", "qwen3_vl")
