"""Qwen3.5 image requests through the engine (tiny random checkpoint, the default dtype and kernels): 16 concurrent
requests, several on one image, two with two images, give bitwise the greedy tokens of one at a time (the M-RoPE
positions and delta ride each request), also with a 3-token prefill chunk budget that ends chunks inside image
runs; each image encoded once; every KV block comes back."""

import pytest
from tiny_qwen3_5_vision import random_image, write_model_dir
from vision_harness import EngineCase, gguf_pair_core, mmproj_core, run_tokens, sixteen_jobs, tokens

from conveyor.multimodal.image_input import ImageInput

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.batch_invariant

IMAGES = [ImageInput.from_pil(random_image(30 + 11 * seed, 40, seed)) for seed in range(4)]
PAD = "<|vision_start|><|image_pad|><|vision_end|>"
JOBS = sixteen_jobs(f"<|im_start|>user\n{PAD}Describe picture {{i}}.<|im_end|>\n",
                    f"<|im_start|>two{PAD}{PAD}\nSame?<|im_end|>\n", IMAGES)
# the mmproj and GGUF pair tests: sizes inside both the directory's pixel limits and clip.cpp's
PAIR_JOBS = [(f"<|im_start|>user\n{PAD}Describe.<|im_end|>\n", [ImageInput.from_pil(random_image(w, h, seed))])
             for seed, (w, h) in enumerate([(64, 48), (48, 64)])]


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> EngineCase:
    path = tmp_path_factory.mktemp("qwen3_5_engine")
    write_model_dir(path, transformers)
    return EngineCase(str(path), JOBS, IMAGES)


@pytest.fixture(scope="module")
def alone(case):
    return case.alone()


def test_outputs_depend_on_the_image(alone):
    assert len({tuple(tokens(trace)) for trace in alone[:4]}) > 1


def test_requests_carry_mrope_positions(case):
    core = case.core()
    ids = core.tokenizer.encode(JOBS[3][0], add_special_tokens=False)
    request = core.make_request(ids, case.params, images=[IMAGES[3]])
    assert request.rope_positions is not None and request.rope_delta < 0


def test_concurrent_equals_one_at_a_time_and_encodes_each_image_once(case, alone):
    case.check_concurrent(alone)


def test_chunk_budget_inside_an_image(case, alone):
    case.check_chunk_budget(alone)


def test_mmproj_equals_the_hf_directory(case, tmp_path):
    """llama.cpp's qwen3vl_merger mmproj beside the directory's text model == the directory's own tower (images whose
    resized area is inside both the directory's pixel limits and clip.cpp's, which the mmproj takes)."""
    from tiny_qwen3_5_vision import hf_model, write_mmproj

    from conveyor.loading.hf_loader import load_hf_dir

    write_mmproj(tmp_path / "mmproj.gguf", hf_model(transformers))  # the directory's weights (same seed)
    core = mmproj_core(load_hf_dir(case.model_dir), str(tmp_path / "mmproj.gguf"), enable_prefix_caching=False)
    assert core.vision is not None and core.vision.model_type == "qwen3_5"
    assert [case.run(core, [job])[0] for job in PAIR_JOBS] == EngineCase(case.model_dir, PAIR_JOBS, []).alone()


def test_gguf_text_and_mmproj(case, tmp_path):
    """llama-server's pair: the qwen35 text GGUF (its rope.dimension_sections the M-RoPE sections) + the mmproj ==
    the directory, same greedy tokens (image requests, concurrent)."""
    from tiny_qwen3_5_vision import hf_model, write_mmproj, write_text_gguf

    model = hf_model(transformers)
    write_mmproj(tmp_path / "mmproj.gguf", model)
    write_text_gguf(tmp_path / "text.gguf", model)
    core = gguf_pair_core(str(tmp_path / "text.gguf"), str(tmp_path / "mmproj.gguf"))
    assert core.model_config.mrope_section == (2, 1, 1)
    direct = case.core(dtype="float32")
    assert run_tokens(core, PAIR_JOBS, tokenizer=direct.tokenizer) == run_tokens(direct, PAIR_JOBS)
