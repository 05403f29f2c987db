"""Gemma 3 image requests through the engine (tiny random checkpoint, bf16, the kernels): 16 concurrent requests,
several on one image, give bitwise the greedy tokens of one at a time, also with a prefill chunk budget smaller
than an image run and under preemption; a prefix hit on the same image is the cold output, a different image
with the same placeholder tokens does not hit; each distinct image is encoded once; every KV block comes back."""

import pytest
from tiny_gemma3_vision import random_image, write_model_dir
from vision_harness import EngineCase, run_requests, sixteen_jobs, tokens

from conveyor.config import EngineConfig
from conveyor.engine.engine import EngineCore
from conveyor.engine.sampling_params import SamplingParams
from conveyor.errors import InvalidRequestError
from conveyor.multimodal.image_input import ImageInput

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.batch_invariant

IMAGES = [ImageInput.from_pil(random_image(seed, (30 + 9 * seed, 40))) for seed in range(5)]
# 16 jobs: images 0-4 shared between jobs, two jobs with two images
JOBS = sixteen_jobs("<bos><start_of_turn>user\n<start_of_image>Describe picture {i} in words.<end_of_turn>\n"
                    "<start_of_turn>model\n",
                    "<bos><start_of_turn>user\nThese two:\n<start_of_image><start_of_image>\nSame?<end_of_turn>\n"
                    "<start_of_turn>model\n", IMAGES)
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> EngineCase:
    path = tmp_path_factory.mktemp("gemma3_vision_engine")
    write_model_dir(path, transformers)
    return EngineCase(str(path), JOBS, IMAGES, PARAMS)


@pytest.fixture(scope="module")
def alone(case):
    return case.alone()


def test_outputs_depend_on_the_image(alone):
    answers = [tokens(trace) for trace in alone]
    assert len({tuple(t) for t in answers[:5]}) > 1  # five images, the same words around them
    assert all(answers[i] == answers[i + 5] or JOBS[i][0] != JOBS[i + 5][0] for i in range(5))


def test_concurrent_equals_one_at_a_time_and_encodes_each_image_once(case, alone):
    core = case.check_concurrent(alone, up_front=True)
    assert max(core.counters.batch_size_counts) == len(JOBS)  # all 16 rows in one forward


def test_chunk_budget_smaller_than_an_image_run(case, alone):
    case.check_chunk_budget(alone)


def test_preemption_keeps_outputs_exact(case, alone):
    # 16 rows of ~60 tokens (8 blocks each at the end) in 64 blocks: rows are preempted and re-prefilled
    case.check_preemption(alone, num_blocks=64)


def test_prefix_hit_needs_the_same_image(case, alone):
    core = case.core()
    text = JOBS[0][0]
    assert case.run(core, [(text, [IMAGES[0]])]) == alone[:1]
    request = core.make_request(core.tokenizer.encode(text, add_special_tokens=False), PARAMS, images=[IMAGES[0]])
    image_start = request.images[0].offset
    # the same image: a hit past the image, bitwise the cold output
    run_requests(core, [request])
    assert request.num_cached_tokens > request.images[0].end
    assert case.run(core, [(text, [IMAGES[0]])]) == alone[:1]
    # another image, the same placeholder tokens: no block past the image's start is shared
    other = core.make_request(core.tokenizer.encode(text, add_special_tokens=False), PARAMS, images=[IMAGES[1]])
    assert other.prompt_token_ids == request.prompt_token_ids
    run_requests(core, [other])
    assert other.num_cached_tokens <= image_start
    cold = case.run(case.core(enable_prefix_caching=False), [(text, [IMAGES[1]])])[0]
    assert other.output_token_ids == tokens(cold) != tokens(alone[0])
    core.kv.check_integrity()


def test_images_to_a_text_model_and_wrong_marker_counts_are_refused(case, tiny_checkpoint):
    text_core = EngineCore(EngineConfig(parallel=2), checkpoint=tiny_checkpoint)
    with pytest.raises(InvalidRequestError, match="does not accept images"):
        text_core.make_request([1, 2, 3], PARAMS, images=[IMAGES[0]])
    core = case.core()
    ids = core.tokenizer.encode(JOBS[0][0], add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="image markers"):
        core.make_request(ids, PARAMS, images=IMAGES[:2])


def test_no_vlm_prefix_cache_keeps_image_requests_out_of_the_cache(case):
    core = case.core(vlm_prefix_cache=False)
    ids = core.tokenizer.encode(JOBS[0][0], add_special_tokens=False)
    assert not core.make_request(ids, PARAMS, images=[IMAGES[0]]).cache_prompt
    assert core.make_request(core.tokenizer.encode("plain text"), PARAMS).cache_prompt


def test_rows_keep_decoding_while_an_image_encodes(case, alone):
    """The tower runs on its own thread: a request whose image is still encoding waits, the others step on."""
    import threading

    core = case.core()
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
    assert image.output_token_ids == tokens(alone[0])
    core.kv.check_integrity()


def test_a_failing_tower_fails_only_its_request(case):
    core = case.core()

    class Broken:
        def encode(self, item):
            raise RuntimeError("tower exploded")

    core.runner.encoder_cache.encoder = Broken()
    text = core.make_request(core.tokenizer.encode("plain text request"), PARAMS)
    image = core.make_request(core.tokenizer.encode(JOBS[0][0], add_special_tokens=False), PARAMS,
                              images=[IMAGES[0]])
    run_requests(core, [text, image])  # the failed request's blocks come back too
    assert image.finish_reason == "error" and "tower exploded" in image.error
    assert len(text.output_token_ids) == PARAMS.max_tokens


def test_disk_tier_brings_an_image_prefix_back_and_never_for_another_image(case, alone, tmp_path):
    """Blocks spilled at shutdown come back in a new engine for the same image (bitwise the cold output); the
    same placeholder tokens with another image read nothing past the image's start."""
    first = case.core(prompt_cache_dir=str(tmp_path), prompt_cache_preload="0")
    assert case.run(first, [JOBS[0]]) == alone[:1]
    first.close()
    again = case.core(prompt_cache_dir=str(tmp_path), prompt_cache_preload="0")
    text = JOBS[0][0]
    ids = again.tokenizer.encode(text, add_special_tokens=False)
    other = again.make_request(ids, PARAMS, images=[IMAGES[1]])
    image_start = other.images[0].offset
    run_requests(again, [other])
    assert other.num_cached_tokens <= image_start
    same = again.make_request(ids, PARAMS, images=[IMAGES[0]])
    run_requests(again, [same])
    assert same.num_cached_tokens > same.images[0].end
    assert same.output_token_ids == tokens(alone[0])
    assert again.disk_report()["hits"] > 0
    again.kv.check_integrity()


def test_llm_chat_with_an_image_part(case, alone):
    """The offline API: an {"type": "image", "image": PIL} content part goes through the model's chat template."""
    from conveyor.engine.llm import LLM

    llm = LLM(model=case.model_dir, parallel=4, block_size=8, speculative_ngram=0)
    messages = [{"role": "user", "content": [{"type": "image", "image": IMAGES[0].image},
                                             {"type": "text", "text": "Describe picture 0 in words."}]}]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    result = llm.chat(messages, params)
    assert result.token_ids == tokens(alone[0])
    assert result.prompt_token_ids == llm.engine.make_request(
        llm.tokenizer.encode(JOBS[0][0], add_special_tokens=False), params, images=[IMAGES[0]]).prompt_token_ids
    raw = llm.generate(JOBS[1][0], params, images=[[IMAGES[1].image]])[0]
    assert raw.token_ids == tokens(alone[1])


def test_an_image_the_prefix_cache_covers_is_not_encoded_again(case, alone):
    core = case.core()
    assert case.run(core, [JOBS[0]]) == alone[:1]
    cache = core.runner.encoder_cache
    cache._rows.clear()  # as if evicted from the LRU: only the KV prefix cache still holds the image
    assert case.run(core, [JOBS[0]]) == alone[:1]
    assert cache.num_encoded == 1
