"""Gemma 3's vision side from llama.cpp's mmproj GGUF (--mmproj): the same tower weights as the HF directory, and
through the engine the same greedy tokens as the HF directory's own tower."""

from dataclasses import replace

import pytest
import torch
from tiny_gemma3_vision import random_image, write_mmproj, write_model_dir
from vision_harness import run_tokens

from conveyor.config import EngineConfig
from conveyor.engine.engine import EngineCore
from conveyor.engine.sampling_params import SamplingParams
from conveyor.loading.checkpoint import LoadError
from conveyor.loading.hf_loader import load_hf_dir
from conveyor.loading.mmproj import read_mmproj
from conveyor.multimodal.image_input import ImageInput

transformers = pytest.importorskip("transformers")

PROMPT = "<bos><start_of_turn>user\n<start_of_image>What is it?<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_mmproj")
    hf = write_model_dir(path / "hf", transformers)
    write_mmproj(path / "mmproj.gguf", hf)
    write_mmproj(path / "mmproj-f16.gguf", hf, projection_f16=True)
    return path, load_hf_dir(str(path / "hf"))


def test_mmproj_gives_the_hf_tensors_and_config(tiny):
    path, checkpoint = tiny
    vision = read_mmproj(str(path / "mmproj.gguf"), checkpoint.tokenizer)
    hf = checkpoint.vision
    for name, tensor in vision.weights.items():
        hf_name = name.replace("vision_tower.vision_model.", "vision_tower.")  # transformers 5 saves it so
        expected = hf.weights[hf_name].float()
        if name.endswith("soft_emb_norm.weight"):  # stored as 1 + w: the scale the tower multiplies by is exact
            tensor, expected = 1 + tensor, 1 + expected
        assert torch.equal(tensor, expected), name
    assert len(vision.weights) == len([n for n in hf.weights if "vision_tower" in n and ".head." not in n]) + 2
    for key in ("mm_tokens_per_image", "boi_token_index", "eoi_token_index", "image_token_index"):
        assert vision.config[key] == hf.config[key]


def _greedy(core: EngineCore, images) -> list[list[int]]:
    return run_tokens(core, [(PROMPT, [image]) for image in images],
                      SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))


def test_engine_with_mmproj_equals_the_hf_directory(tiny):
    path, checkpoint = tiny
    images = [ImageInput.from_pil(random_image(seed)) for seed in range(3)]
    want = _greedy(EngineCore(EngineConfig(parallel=4), checkpoint=checkpoint), images)
    text_only = replace(checkpoint, vision=None)
    got = _greedy(EngineCore(EngineConfig(parallel=4, mmproj=str(path / "mmproj.gguf")), checkpoint=text_only), images)
    assert got == want
    f16 = EngineCore(EngineConfig(parallel=4, mmproj=str(path / "mmproj-f16.gguf")), checkpoint=text_only)
    assert f16.vision is not None and len(_greedy(f16, images)) == 3  # as llama.cpp writes it: the projection in F16


def test_other_projectors_are_refused(tiny, tmp_path):
    path, checkpoint = tiny
    from tiny_gemma3_vision import hf_model

    write_mmproj(tmp_path / "other.gguf", hf_model(transformers), projector_type="minicpmv")
    with pytest.raises(LoadError, match="projector type 'minicpmv' is not supported"):
        read_mmproj(str(tmp_path / "other.gguf"), checkpoint.tokenizer)


def test_a_gguf_vocabulary_without_the_soft_token_uses_pad(tiny):
    """llama.cpp's Gemma 3 GGUFs stop at tokenizer.model's pieces: no <image_soft_token>; pad stands in."""
    path, checkpoint = tiny

    class CutVocabulary:
        def token_to_id(self, token):
            return None if token == "<image_soft_token>" else checkpoint.tokenizer.token_to_id(token)

    vision = read_mmproj(str(path / "mmproj.gguf"), CutVocabulary())
    assert vision.config["image_token_index"] == 0 and vision.config["boi_token_index"] == 5


def test_a_projector_for_another_text_model_is_refused(tiny, tiny_checkpoint):
    path, checkpoint = tiny
    with pytest.raises(LoadError, match="cannot feed a llama text model"):
        read_mmproj(str(path / "mmproj.gguf"), checkpoint.tokenizer, tiny_checkpoint.config)
    narrow = replace(checkpoint.config, hidden_size=32)
    with pytest.raises(LoadError, match="64-wide embeddings, the text model is 32 wide"):
        read_mmproj(str(path / "mmproj.gguf"), checkpoint.tokenizer, narrow)
    assert read_mmproj(str(path / "mmproj.gguf"), checkpoint.tokenizer, checkpoint.config).model_type == "gemma3"
