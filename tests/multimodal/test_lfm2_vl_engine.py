"""LFM2-VL image requests through the engine (tiny random checkpoint, the default dtype and kernels; the text model
is LFM2's conv + attention hybrid): 16 concurrent requests, several on one image, split (tiles + thumbnail: several
embed runs per image) and whole, two with two images, give bitwise the greedy tokens of one at a time, also with a
3-token prefill chunk budget; each image encoded once; every KV block comes back."""

import pytest
from tiny_lfm2_vl import random_image, write_model_dir

from conveyor.config import EngineConfig
from conveyor.engine.engine import EngineCore
from conveyor.engine.sampling_params import SamplingParams
from conveyor.multimodal.image_input import ImageInput

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.batch_invariant

# two split (over 1024 pixels after rounding), two whole
IMAGES = [ImageInput.from_pil(random_image(w, h, seed)) for seed, (w, h) in enumerate(((50, 40), (20, 30),
                                                                                          (70, 20), (24, 24)))]
JOBS = [(f"<|startoftext|><|im_start|>user\n<image>Describe picture {i}.<|im_end|>\n", [IMAGES[i % 4]])
        for i in range(14)]
JOBS += [("<|startoftext|><|im_start|>two<image><image>\nSame?<|im_end|>\n", [IMAGES[a], IMAGES[b]])
         for a, b in ((0, 3), (3, 0))]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lfm2_vl_engine")
    write_model_dir(path, transformers)
    return str(path)


def _core(model_dir, **fields) -> EngineCore:
    return EngineCore(EngineConfig(model=model_dir, parallel=16, block_size=8, speculative_ngram=0, **fields))


def _run(core: EngineCore, jobs) -> list[list[tuple[int, float]]]:
    requests = [core.make_request(core.tokenizer.encode(text, add_special_tokens=False), PARAMS, images=images)
                for text, images in jobs]
    for request in requests:
        core.add_request(request)
    traces = {r.request_id: [] for r in requests}
    while core.has_work():
        for out in core.step():
            traces[out.request_id] += [(lp.token_id, lp.logprob) for lp in out.logprobs]
    core.kv.check_integrity()
    assert core.pool.stats().num_used == 0
    return [traces[r.request_id] for r in requests]


@pytest.fixture(scope="module")
def alone(model_dir):
    core = _core(model_dir, enable_prefix_caching=False)
    return [_run(core, [job])[0] for job in JOBS]


def test_outputs_depend_on_the_image(alone):
    assert len({tuple(t for t, _ in trace) for trace in alone[:4]}) > 1


def test_split_images_have_a_run_per_frame(model_dir):
    core = _core(model_dir)
    ids = core.tokenizer.encode(JOBS[0][0], add_special_tokens=False)
    item = core.make_request(ids, PARAMS, images=[IMAGES[0]]).images[0]
    assert len(item.embed_runs) == len(item.extras["shapes"]) == 5  # 2 x 2 tiles + the thumbnail


def test_concurrent_equals_one_at_a_time_and_encodes_each_image_once(model_dir, alone):
    core = _core(model_dir)
    assert _run(core, JOBS) == alone
    assert core.runner.encoder_cache.num_encoded == len(IMAGES)


def test_chunk_budget_smaller_than_a_tile(model_dir, alone):
    core = _core(model_dir, prefill_chunk_size=3, enable_prefix_caching=False)
    assert _run(core, JOBS) == alone


def _tokens(engine, jobs) -> list[list[int]]:
    requests = [engine.make_request(engine.tokenizer.encode(text, add_special_tokens=False), PARAMS, images=images)
                for text, images in jobs]
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
    return [r.output_token_ids for r in requests]


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
    from dataclasses import replace

    from conveyor.loading.hf_loader import load_hf_dir

    text_only = replace(load_hf_dir(str(mmproj_pair)), vision=None)
    core = EngineCore(EngineConfig(parallel=16, block_size=8, speculative_ngram=0, enable_prefix_caching=False,
                                   mmproj=str(mmproj_pair / "mmproj.gguf")), checkpoint=text_only)
    assert core.vision is not None and core.vision.model_type == "lfm2_vl"
    direct = _core(str(mmproj_pair), enable_prefix_caching=False)
    assert [_run(core, [job])[0] for job in MMPROJ_JOBS] == [_run(direct, [job])[0] for job in MMPROJ_JOBS]


def test_gguf_text_and_mmproj(mmproj_pair):
    """llama-server's pair: the lfm2 text GGUF + the mmproj == the directory, same greedy tokens (fp32, concurrent)."""
    core = EngineCore(EngineConfig(model=str(mmproj_pair / "text.gguf"), mmproj=str(mmproj_pair / "mmproj.gguf"),
                                   parallel=16, block_size=8, speculative_ngram=0, dtype="float32"))
    direct = _core(str(mmproj_pair), dtype="float32")
    got = _tokens(core, MMPROJ_JOBS)
    assert got == _tokens(direct, MMPROJ_JOBS)
    assert got[0] != got[1]  # the two images answer differently


def test_mmproj_refuses_another_text_model(mmproj_pair, tmp_path):
    from conveyor.loading.checkpoint import LoadError
    from conveyor.loading.mmproj import read_mmproj
    from conveyor.testing import tiny_config

    config = tiny_config(128)  # a llama text model
    with pytest.raises(LoadError, match="cannot feed"):
        read_mmproj(str(mmproj_pair / "mmproj.gguf"), _core(str(mmproj_pair)).tokenizer, config)
