"""llama.cpp's qwen3vl_merger mmproj of a Qwen3-VL (DeepStack mergers as v.deepstack.{block}.*) loads as the same
tower as the Hugging Face directory: bitwise the same rows, every level (fp32); refusals, among them a text GGUF
whose n_deepstack_layers is not the mmproj's level count."""

from __future__ import annotations

import pytest
import torch
from tiny_qwen3_vl import DEEPSTACK, IMAGE, hf_model, random_image, write_mmproj, write_model_dir, write_text_gguf

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


@pytest.mark.parametrize("levels", [0, 1, 3])
def test_a_text_gguf_expecting_other_deepstack_levels_is_refused(sources, tmp_path, levels):
    """The text model adds whatever levels come, so a mismatch would be wrong output: a load error instead."""
    from conveyor.loading.gguf_loader import load_gguf
    from conveyor.loading.mmproj import read_mmproj

    _, mmproj = sources
    model = hf_model(transformers)
    write_text_gguf(tmp_path / "text.gguf", model, deepstack_levels=levels)
    text = load_gguf(str(tmp_path / "text.gguf"))
    assert text.config.num_deepstack_levels == levels
    with pytest.raises(LoadError) as error:
        read_mmproj(mmproj, text.tokenizer, text.config)
    assert str(error.value) == (f"{mmproj}: the mmproj has {len(DEEPSTACK)} DeepStack levels, the qwen3_vl_text text "
                                f"model expects {levels} (its n_deepstack_layers)")
    write_text_gguf(tmp_path / "text.gguf", model)  # as the converter writes it: the pair loads
    text = load_gguf(str(tmp_path / "text.gguf"))
    assert text.config.num_deepstack_levels == len(DEEPSTACK)
    assert read_mmproj(mmproj, text.tokenizer, text.config).model_type == "qwen3_vl"
