"""Gemma 3 image requests through the engine (tiny random checkpoint, bf16, the kernels): 16 concurrent requests,
several on one image, give bitwise the greedy tokens of one at a time, also with a prefill chunk budget smaller
than an image run and under preemption; a prefix hit on the same image is the cold output, a different image
with the same placeholder tokens does not hit; each distinct image is encoded once; every KV block comes back."""

import pytest
import torch
from tiny_gemma3_vision import random_image, write_model_dir

from conveyor.config import EngineConfig
from conveyor.engine.engine import EngineCore
from conveyor.engine.sampling_params import SamplingParams
from conveyor.errors import InvalidRequestError
from conveyor.multimodal.image_input import ImageInput

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.batch_invariant

IMAGES = [ImageInput.from_pil(random_image(seed, (30 + 9 * seed, 40))) for seed in range(5)]
# 16 jobs: (prompt, its images); images 0-4 shared between jobs, two jobs with two images
JOBS = [(f"<bos><start_of_turn>user\n<start_of_image>Describe picture {i} in words.<end_of_turn>\n"
         f"<start_of_turn>model\n", [IMAGES[i % 5]]) for i in range(14)]
JOBS += [("<bos><start_of_turn>user\nThese two:\n<start_of_image><start_of_image>\nSame?<end_of_turn>\n"
          "<start_of_turn>model\n", [IMAGES[a], IMAGES[b]]) for a, b in ((1, 3), (3, 1))]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_vision_engine")
    write_model_dir(path, transformers)
    return str(path)


def _core(model_dir, **fields) -> EngineCore:
    return EngineCore(EngineConfig(model=model_dir, parallel=16, block_size=8, speculative_ngram=0, **fields))


def _run(core: EngineCore, jobs) -> list[list[tuple[int, float]]]:
    """All jobs at once; each one's (token, logprob) trace."""
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
    """One at a time, no prefix cache."""
    core = _core(model_dir, enable_prefix_caching=False)
    return [_run(core, [job])[0] for job in JOBS]


def test_outputs_depend_on_the_image(alone):
    tokens = [[t for t, _ in trace] for trace in alone]
    assert len({tuple(t) for t in tokens[:5]}) > 1  # five images, the same words around them
    assert all(tokens[i] == tokens[i + 5] or JOBS[i][0] != JOBS[i + 5][0] for i in range(5))


def _encode_up_front(core: EngineCore) -> None:
    """Every image through the tower first, so all 16 rows are admitted at once (else the tower's pace spreads
    their admissions over several steps)."""
    ids = core.tokenizer.encode(JOBS[0][0], add_special_tokens=False)
    for image in IMAGES:
        core.runner.encoder_cache.get(core.make_request(ids, PARAMS, images=[image]).images[0])


def test_concurrent_equals_one_at_a_time_and_encodes_each_image_once(model_dir, alone):
    core = _core(model_dir)
    _encode_up_front(core)
    assert _run(core, JOBS) == alone
    assert core.runner.encoder_cache.num_encoded == len(IMAGES)
    assert max(core.counters.batch_size_counts) == len(JOBS)  # all 16 rows in one forward


def test_chunk_budget_smaller_than_an_image_run(model_dir, alone):
    core = _core(model_dir, prefill_chunk_size=3, enable_prefix_caching=False)
    assert _run(core, JOBS) == alone


def test_preemption_keeps_outputs_exact(model_dir, alone):
    # 16 rows of ~60 tokens (8 blocks each at the end) in 64 blocks: rows are preempted and re-prefilled
    roomy = _core(model_dir, enable_prefix_caching=False)
    plan = roomy.pool_plan
    tight = _core(model_dir, enable_prefix_caching=False,
                  kv_cache_budget=str(plan.window_pool_bytes + 64 * plan.bytes_per_block))
    _encode_up_front(tight)
    assert _run(tight, JOBS) == alone
    assert tight.scheduler.stats.num_preemptions > 0


def test_prefix_hit_needs_the_same_image(model_dir, alone):
    core = _core(model_dir)
    text = JOBS[0][0]
    assert _run(core, [(text, [IMAGES[0]])]) == alone[:1]
    request = core.make_request(core.tokenizer.encode(text, add_special_tokens=False), PARAMS, images=[IMAGES[0]])
    image_start = request.images[0].offset
    # the same image: a hit past the image, bitwise the cold output
    core.add_request(request)
    while core.has_work():
        core.step()
    assert request.num_cached_tokens > request.images[0].end
    assert _run(core, [(text, [IMAGES[0]])]) == alone[:1]
    # another image, the same placeholder tokens: no block past the image's start is shared
    other = core.make_request(core.tokenizer.encode(text, add_special_tokens=False), PARAMS, images=[IMAGES[1]])
    assert other.prompt_token_ids == request.prompt_token_ids
    core.add_request(other)
    while core.has_work():
        core.step()
    assert other.num_cached_tokens <= image_start
    cold = _run(_core(model_dir, enable_prefix_caching=False), [(text, [IMAGES[1]])])[0]
    assert other.output_token_ids == [t for t, _ in cold] != [t for t, _ in alone[0]]
    core.kv.check_integrity()


def test_images_to_a_text_model_and_wrong_marker_counts_are_refused(model_dir, tiny_checkpoint):
    text_core = EngineCore(EngineConfig(parallel=2), checkpoint=tiny_checkpoint)
    with pytest.raises(InvalidRequestError, match="does not accept images"):
        text_core.make_request([1, 2, 3], PARAMS, images=[IMAGES[0]])
    core = _core(model_dir)
    ids = core.tokenizer.encode(JOBS[0][0], add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="image markers"):
        core.make_request(ids, PARAMS, images=IMAGES[:2])


def test_no_vlm_prefix_cache_keeps_image_requests_out_of_the_cache(model_dir):
    core = _core(model_dir, vlm_prefix_cache=False)
    ids = core.tokenizer.encode(JOBS[0][0], add_special_tokens=False)
    assert not core.make_request(ids, PARAMS, images=[IMAGES[0]]).cache_prompt
    assert core.make_request(core.tokenizer.encode("plain text"), PARAMS).cache_prompt


def test_rows_keep_decoding_while_an_image_encodes(model_dir, alone):
    """The tower runs on its own thread: a request whose image is still encoding waits, the others step on."""
    import threading

    core = _core(model_dir)
    cache = core.runner.encoder_cache
    release, tower = threading.Event(), cache.encoder

    class Held:
        def encode(self, item):
            release.wait(30)
            return tower.encode(item)

    cache.encoder = Held()
    text = core.make_request(core.tokenizer.encode("plain text request"), PARAMS)
    image = core.make_request(core.tokenizer.encode(JOBS[0][0], add_special_tokens=False), PARAMS,
                              images=[IMAGES[0]])
    core.add_request(text)
    core.add_request(image)
    for _ in range(6):
        core.step()
    assert len(text.output_token_ids) >= 5 and image.num_computed_tokens == 0
    release.set()
    while core.has_work():
        core.step()
    assert image.output_token_ids == [t for t, _ in alone[0]]
    core.kv.check_integrity()


def test_a_failing_tower_fails_only_its_request(model_dir):
    core = _core(model_dir)

    class Broken:
        def encode(self, item):
            raise RuntimeError("tower exploded")

    core.runner.encoder_cache.encoder = Broken()
    text = core.make_request(core.tokenizer.encode("plain text request"), PARAMS)
    image = core.make_request(core.tokenizer.encode(JOBS[0][0], add_special_tokens=False), PARAMS,
                              images=[IMAGES[0]])
    core.add_request(text)
    core.add_request(image)
    while core.has_work():
        core.step()
    assert image.finish_reason == "error" and "tower exploded" in image.error
    assert len(text.output_token_ids) == PARAMS.max_tokens
    core.kv.check_integrity()


def test_disk_tier_brings_an_image_prefix_back_and_never_for_another_image(model_dir, alone, tmp_path):
    """Blocks spilled at shutdown come back in a new engine for the same image (bitwise the cold output); the
    same placeholder tokens with another image read nothing past the image's start."""
    first = _core(model_dir, prompt_cache_dir=str(tmp_path), prompt_cache_preload="0")
    assert _run(first, [JOBS[0]]) == alone[:1]
    first.close()
    again = _core(model_dir, prompt_cache_dir=str(tmp_path), prompt_cache_preload="0")
    text = JOBS[0][0]
    ids = again.tokenizer.encode(text, add_special_tokens=False)
    other = again.make_request(ids, PARAMS, images=[IMAGES[1]])
    image_start = other.images[0].offset
    again.add_request(other)
    while again.has_work():
        again.step()
    assert other.num_cached_tokens <= image_start
    same = again.make_request(ids, PARAMS, images=[IMAGES[0]])
    again.add_request(same)
    while again.has_work():
        again.step()
    assert same.num_cached_tokens > same.images[0].end
    assert same.output_token_ids == [t for t, _ in alone[0]]
    assert again.disk_report()["hits"] > 0
    again.kv.check_integrity()


def test_llm_chat_with_an_image_part(model_dir, alone):
    """The offline API: an {"type": "image", "image": PIL} content part goes through the model's chat template."""
    from conveyor.engine.llm import LLM

    llm = LLM(model=model_dir, parallel=4, block_size=8, speculative_ngram=0)
    messages = [{"role": "user", "content": [{"type": "image", "image": IMAGES[0].image},
                                             {"type": "text", "text": "Describe picture 0 in words."}]}]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    result = llm.chat(messages, params)
    assert result.token_ids == [t for t, _ in alone[0]]
    assert result.prompt_token_ids == llm.engine.make_request(
        llm.tokenizer.encode(JOBS[0][0], add_special_tokens=False), params, images=[IMAGES[0]]).prompt_token_ids
    raw = llm.generate(JOBS[1][0], params, images=[[IMAGES[1].image]])[0]
    assert raw.token_ids == [t for t, _ in alone[1]]


def test_an_image_the_prefix_cache_covers_is_not_encoded_again(model_dir, alone):
    core = _core(model_dir)
    assert _run(core, [JOBS[0]]) == alone[:1]
    cache = core.runner.encoder_cache
    cache._rows.clear()  # as if evicted from the LRU: only the KV prefix cache still holds the image
    assert _run(core, [JOBS[0]]) == alone[:1]
    assert cache.num_encoded == 1
