"""Qwen3-VL image requests through the engine (tiny random checkpoint, the default dtype and kernels; DeepStack levels
riding the image rows): 16 concurrent requests, several on one image, two with two images, give bitwise the greedy
tokens of one at a time (the M-RoPE positions and delta ride each request), also with a 3-token prefill chunk budget
that ends chunks inside image runs (each chunk takes its rows' levels) and under preemption; a prefix hit past the
image == cold; each image encoded once; every KV block comes back; a KV handoff carries the levels; the
llama-server pair (qwen3vl text GGUF + mmproj) == the directory."""

import pytest
from tiny_qwen3_vl import random_image, write_model_dir

from conveyor.config import EngineConfig
from conveyor.engine.engine import EngineCore
from conveyor.engine.sampling_params import SamplingParams
from conveyor.multimodal.image_input import ImageInput

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.batch_invariant

IMAGES = [ImageInput.from_pil(random_image(30 + 11 * seed, 40, seed)) for seed in range(4)]
PAD = "<|vision_start|><|image_pad|><|vision_end|>"
JOBS = [(f"<|im_start|>user\n{PAD}Describe picture {i}.<|im_end|>\n", [IMAGES[i % 4]]) for i in range(14)]
JOBS += [(f"<|im_start|>two{PAD}{PAD}\nSame?<|im_end|>\n", [IMAGES[a], IMAGES[b]]) for a, b in ((1, 3), (3, 1))]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_vl_engine")
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


def test_requests_carry_mrope_positions(model_dir):
    core = _core(model_dir)
    ids = core.tokenizer.encode(JOBS[3][0], add_special_tokens=False)
    request = core.make_request(ids, PARAMS, images=[IMAGES[3]])
    assert request.rope_positions is not None and request.rope_delta < 0


def test_concurrent_equals_one_at_a_time_and_encodes_each_image_once(model_dir, alone):
    core = _core(model_dir)
    assert _run(core, JOBS) == alone
    assert core.runner.encoder_cache.num_encoded == len(IMAGES)


def test_chunk_budget_inside_an_image(model_dir, alone):
    core = _core(model_dir, prefill_chunk_size=3, enable_prefix_caching=False)
    assert _run(core, JOBS) == alone


def test_preemption_keeps_outputs_exact(model_dir, alone):
    """Rows preempted and re-prefilled (their images' rows and levels taken again from the encoder cache)."""
    roomy = _core(model_dir, enable_prefix_caching=False)
    plan = roomy.pool_plan
    tight = _core(model_dir, enable_prefix_caching=False, ctx_size=16 * 512,  # 64 blocks a slot, the least
                  kv_cache_budget=str(plan.window_pool_bytes + 64 * plan.bytes_per_block))
    ids = tight.tokenizer.encode(JOBS[0][0], add_special_tokens=False)
    for image in IMAGES:  # every image through the tower first, so all 16 rows are admitted together
        tight.runner.encoder_cache.get(tight.make_request(ids, PARAMS, images=[image]).images[0])
    assert _run(tight, JOBS) == alone
    assert tight.scheduler.stats.num_preemptions > 0


def test_prefix_hit_past_an_image_equals_cold(model_dir, alone):
    """A second round on the same prompts hits the prefix cache past the image rows (their DeepStack levels are in
    the KV already), bitwise the cold tokens."""
    core = _core(model_dir)
    assert _run(core, JOBS[:4]) == alone[:4]
    hits = core.kv.counters.hit_tokens
    assert _run(core, JOBS[:4]) == alone[:4]
    image_ends = [core.make_request(core.tokenizer.encode(text, add_special_tokens=False), PARAMS,
                                    images=images).images[-1].end for text, images in JOBS[:4]]
    assert core.kv.counters.hit_tokens - hits > sum(image_ends)


def test_gguf_text_and_mmproj(model_dir, tmp_path):
    """llama-server's pair: the qwen3vl text GGUF (rope.dimension_sections the M-RoPE sections) + the qwen3vl_merger
    mmproj with its DeepStack layers == the directory, same greedy tokens (image requests, concurrent)."""
    from tiny_qwen3_vl import hf_model, write_mmproj, write_text_gguf

    model = hf_model(transformers)
    write_mmproj(tmp_path / "mmproj.gguf", model)
    write_text_gguf(tmp_path / "text.gguf", model)
    core = EngineCore(EngineConfig(model=str(tmp_path / "text.gguf"), mmproj=str(tmp_path / "mmproj.gguf"),
                                   parallel=16, block_size=8, speculative_ngram=0, dtype="float32"))
    assert core.model_config.architecture == "qwen3_vl_text" and core.model_config.mrope_section == (3, 3, 2)
    assert core.vision.model_type == "qwen3_vl" and core.vision.encoder.num_levels == 2
    direct = _core(model_dir, dtype="float32")
    images = [ImageInput.from_pil(random_image(w, h, seed)) for seed, (w, h) in enumerate([(64, 48), (48, 64)])]
    jobs = [(f"<|im_start|>user\n{PAD}Describe.<|im_end|>\n", [image]) for image in images]
    ids = [direct.tokenizer.encode(text, add_special_tokens=False) for text, _ in jobs]

    def tokens(engine):
        requests = [engine.make_request(i, PARAMS, images=images) for i, (_, images) in zip(ids, jobs)]
        for r in requests:
            engine.add_request(r)
        while engine.has_work():
            engine.step()
        return [r.output_token_ids for r in requests]

    assert tokens(core) == tokens(direct)


def test_a_handoff_carries_the_levels(model_dir, alone):
    """A prefill node's handoff carries each image's rows with their DeepStack levels (64 x 3 wide); the decode node
    continues it bitwise, imported or re-prefilled from the carried rows, never running its tower."""
    import asyncio
    from types import SimpleNamespace

    from conveyor.cluster import wire
    from conveyor.cluster.decode import DecodeNode
    from conveyor.cluster.prefill import handoff_frame
    from conveyor.config import ClusterConfig
    from conveyor.engine.kv_transfer import KVBlob

    prefill, decode = _core(model_dir), _core(model_dir)
    node = DecodeNode(SimpleNamespace(core=decode), ClusterConfig(node_role="decode", serving_bind="127.0.0.1:1"))
    assert decode.vision.row_width(64) == 64 * 3

    async def take(frame: wire.HandoffFrame, recompute: bool):
        blob = KVBlob(**{name: getattr(frame.kv, name) for name in frame.kv.__struct_fields__})
        request = await node._request(frame, blob)
        if recompute:  # as when no block is free at arrival: re-prefilled here from the carried rows
            decode.kv_transfer.forget(request.request_id)
        decode.add_request(request)
        while decode.has_work():
            decode.step()
        return request

    for job, recompute in ((0, False), (14, False), (15, True)):
        text, images = JOBS[job]
        name = f"job{job}"
        request = prefill.make_request(prefill.tokenizer.encode(text, add_special_tokens=False), PARAMS, name,
                                       images=images)
        prefill.kv_transfer.mark_for_handoff(name)
        prefill.add_request(request)
        handoff = None
        while handoff is None:
            handoff = next((o.kv_handoff for o in prefill.step() if o.kv_handoff is not None), None)
        frame = wire.decode(wire.encode(handoff_frame(handoff, None))[wire.HEADER.size:])
        assert all(span.hidden == 64 * 3 for span in frame.images)
        got = asyncio.run(take(frame, recompute))
        assert got.output_token_ids == [t for t, _ in alone[job]], job
    assert decode.runner.encoder_cache.num_encoded == 0
    assert decode.kv_transfer.stats.num_imported == 2
    for core in (prefill, decode):
        core.kv.check_integrity()
        assert core.pool.stats().num_used == 0
