"""Idefics3 / SmolVLM image requests through the engine (tiny random checkpoint, the default dtype and kernels):
16 concurrent requests, several on one image, split (several tiles, several embed runs per image) and not, give
bitwise the greedy tokens of one at a time, also with a 3-token prefill chunk budget; each image encoded once;
every KV block comes back."""

import pytest
from tiny_idefics3 import random_image, write_model_dir
from vision_harness import EngineCase, mmproj_core, sixteen_jobs, tokens

from conveyor.multimodal.image_input import ImageInput

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.batch_invariant

IMAGES = [ImageInput.from_pil(random_image(seed, (30 + 9 * seed, 40))) for seed in range(4)]
JOBS = sixteen_jobs("<|im_start|>User:<image>Describe picture {i}.<end_of_utterance>\nAssistant:",
                    "<|im_start|>User: two<image><image>\nSame?<end_of_utterance>\nAssistant:", IMAGES)


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> EngineCase:
    path = tmp_path_factory.mktemp("idefics3_engine")
    write_model_dir(path, transformers, split=True)
    return EngineCase(str(path), JOBS, IMAGES)


@pytest.fixture(scope="module")
def alone(case):
    return case.alone()


def test_outputs_depend_on_the_image(alone):
    assert len({tuple(tokens(trace)) for trace in alone[:4]}) > 1


def test_split_images_have_a_run_per_frame(case):
    core = case.core()
    ids = core.tokenizer.encode(JOBS[0][0], add_special_tokens=False)
    item = core.make_request(ids, case.params, images=[IMAGES[0]]).images[0]
    assert len(item.embed_runs) == item.pixel_values.shape[0] > 1


def test_concurrent_equals_one_at_a_time_and_encodes_each_image_once(case, alone):
    case.check_concurrent(alone)


def test_chunk_budget_smaller_than_a_tile(case, alone):
    case.check_chunk_budget(alone)


def test_mmproj_equals_the_hf_directory(case, alone, tmp_path):
    """llama.cpp's mmproj (projector type idefics3) beside the text model == the directory's own tower."""
    from tiny_idefics3 import hf_model, write_mmproj

    from conveyor.loading.hf_loader import load_hf_dir

    write_mmproj(tmp_path / "mmproj.gguf", hf_model(transformers))  # seed 0: the directory's weights
    core = mmproj_core(load_hf_dir(case.model_dir), str(tmp_path / "mmproj.gguf"), enable_prefix_caching=False)
    assert core.vision is not None and core.vision.model_type == "idefics3"
    assert [case.run(core, [job])[0] for job in JOBS[:4]] == alone[:4]
