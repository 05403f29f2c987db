"""LFM2-VL image requests through the engine (tiny random checkpoint, the default dtype and kernels; the text model
is LFM2's conv + attention hybrid): 16 concurrent requests, several on one image, split (tiles + thumbnail: several
embed runs per image) and whole, two with two images, give bitwise the greedy tokens of one at a time, also with a
3-token prefill chunk budget; each image encoded once; every KV block comes back."""

import pytest
from tiny_lfm2_vl import random_image, write_model_dir
from vision_harness import EngineCase, gguf_pair_core, mmproj_core, run_tokens, sixteen_jobs, tokens

from conveyor.multimodal.image_input import ImageInput

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.batch_invariant

# two split (over 1024 pixels after rounding), two whole
IMAGES = [ImageInput.from_pil(random_image(w, h, seed)) for seed, (w, h) in enumerate(((50, 40), (20, 30),
                                                                                          (70, 20), (24, 24)))]
JOBS = sixteen_jobs("<|startoftext|><|im_start|>user\n<image>Describe picture {i}.<|im_end|>\n",
                    "<|startoftext|><|im_start|>two<image><image>\nSame?<|im_end|>\n", IMAGES, pairs=((0, 3), (3, 0)))


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> EngineCase:
    path = tmp_path_factory.mktemp("lfm2_vl_engine")
    write_model_dir(path, transformers)
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
    assert len(item.embed_runs) == len(item.extras["shapes"]) == 5  # 2 x 2 tiles + the thumbnail


def test_concurrent_equals_one_at_a_time_and_encodes_each_image_once(case, alone):
    case.check_concurrent(alone)


def test_chunk_budget_smaller_than_a_tile(case, alone):
    case.check_chunk_budget(alone)


@pytest.fixture(scope="module")
def mmproj_pair(tmp_path_factory):
    """A directory with the processor settings an mmproj implies (clip.cpp's 64..256 tokens), its mmproj and its
    text model as llama.cpp's converter writes them."""
    from tiny_lfm2_vl import MMPROJ_PROCESSOR, write_mmproj, write_text_gguf

    path = tmp_path_factory.mktemp("lfm2_vl_mmproj")
    model = write_model_dir(path, transformers, processor=MMPROJ_PROCESSOR)
    write_mmproj(path / "mmproj.gguf", model)
    write_text_gguf(path / "text.gguf", model)
    return path


MMPROJ_JOBS = [(f"<|startoftext|><|im_start|>user\n<image>Describe {i}.<|im_end|>\n",
                [ImageInput.from_pil(random_image(w, h, 20 + i))]) for i, (w, h) in enumerate(((40, 30), (30, 90)))]


def test_mmproj_equals_the_hf_directory(mmproj_pair):
    """llama.cpp's lfm2 mmproj beside the directory's text model == the directory's own tower, bitwise."""
    from conveyor.loading.hf_loader import load_hf_dir

    direct = EngineCase(str(mmproj_pair), MMPROJ_JOBS, [image for _, (image,) in MMPROJ_JOBS])
    core = mmproj_core(load_hf_dir(str(mmproj_pair)), str(mmproj_pair / "mmproj.gguf"), enable_prefix_caching=False)
    assert core.vision is not None and core.vision.model_type == "lfm2_vl"
    assert [direct.run(core, [job])[0] for job in MMPROJ_JOBS] == direct.alone()


def test_gguf_text_and_mmproj(mmproj_pair):
    """llama-server's pair: the lfm2 text GGUF + the mmproj == the directory, same greedy tokens (fp32, concurrent)."""
    core = gguf_pair_core(str(mmproj_pair / "text.gguf"), str(mmproj_pair / "mmproj.gguf"))
    direct = EngineCase(str(mmproj_pair), MMPROJ_JOBS, []).core(dtype="float32")
    got = run_tokens(core, MMPROJ_JOBS)
    assert got == run_tokens(direct, MMPROJ_JOBS)
    assert got[0] != got[1]  # the two images answer differently


def test_mmproj_refuses_another_text_model(mmproj_pair):
    from conveyor.loading.checkpoint import LoadError
    from conveyor.loading.hf_loader import load_hf_dir
    from conveyor.loading.mmproj import read_mmproj
    from conveyor.testing import tiny_config

    config = tiny_config(128)  # a llama text model
    with pytest.raises(LoadError, match="cannot feed"):
        read_mmproj(str(mmproj_pair / "mmproj.gguf"), load_hf_dir(str(mmproj_pair)).tokenizer, config)
