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
