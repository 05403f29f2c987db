"""Qwen3-VL image requests through the engine (tiny random checkpoint, the default dtype and kernels; DeepStack levels
riding the image rows): 16 concurrent requests, several on one image, two with two images, give bitwise the greedy
tokens of one at a time (the M-RoPE positions and delta ride each request), also with a 3-token prefill chunk budget
that ends chunks inside image runs (each chunk takes its rows' levels) and under preemption; a prefix hit past the
image == cold; each image encoded once; every KV block comes back; a KV handoff carries the levels; the
llama-server pair (qwen3vl text GGUF + mmproj) == the directory."""

import pytest
from tiny_qwen3_vl import random_image, write_model_dir
from vision_harness import EngineCase, check_no_leak, gguf_pair_core, run_tokens, sixteen_jobs, tokens

from conveyor.multimodal.image_input import ImageInput

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.batch_invariant

IMAGES = [ImageInput.from_pil(random_image(30 + 11 * seed, 40, seed)) for seed in range(4)]
PAD = "<|vision_start|><|image_pad|><|vision_end|>"
JOBS = sixteen_jobs(f"<|im_start|>user\n{PAD}Describe picture {{i}}.<|im_end|>\n",
                    f"<|im_start|>two{PAD}{PAD}\nSame?<|im_end|>\n", IMAGES)
# the GGUF pair test: sizes inside both the directory's pixel limits and clip.cpp's
PAIR_JOBS = [(f"<|im_start|>user\n{PAD}Describe.<|im_end|>\n", [ImageInput.from_pil(random_image(w, h, seed))])
             for seed, (w, h) in enumerate([(64, 48), (48, 64)])]


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> EngineCase:
    path = tmp_path_factory.mktemp("qwen3_vl_engine")
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


def test_preemption_keeps_outputs_exact(case, alone):
    """Rows preempted and re-prefilled (their images' rows and levels taken again from the encoder cache)."""
    case.check_preemption(alone, num_blocks=64, ctx_size=16 * 512)  # 64 blocks a slot, the least


def test_prefix_hit_past_an_image_equals_cold(case, alone):
    """A second round on the same prompts hits the prefix cache past the image rows (their DeepStack levels are in
    the KV already), bitwise the cold tokens."""
    core = case.core()
    assert case.run(core, JOBS[:4]) == alone[:4]
    hits = core.kv.counters.hit_tokens
    assert case.run(core, JOBS[:4]) == alone[:4]
    image_ends = [core.make_request(core.tokenizer.encode(text, add_special_tokens=False), case.params,
                                    images=images).images[-1].end for text, images in JOBS[:4]]
    assert core.kv.counters.hit_tokens - hits > sum(image_ends)


def test_gguf_text_and_mmproj(case, tmp_path):
    """llama-server's pair: the qwen3vl text GGUF (rope.dimension_sections the M-RoPE sections) + the qwen3vl_merger
    mmproj with its DeepStack layers == the directory, same greedy tokens (image requests, concurrent)."""
    from tiny_qwen3_vl import hf_model, write_mmproj, write_text_gguf

    model = hf_model(transformers)
    write_mmproj(tmp_path / "mmproj.gguf", model)
    write_text_gguf(tmp_path / "text.gguf", model)
    core = gguf_pair_core(str(tmp_path / "text.gguf"), str(tmp_path / "mmproj.gguf"))
    assert core.model_config.architecture == "qwen3_vl_text" and core.model_config.mrope_section == (3, 3, 2)
    assert core.vision.model_type == "qwen3_vl" and core.vision.encoder.num_levels == 2
    direct = case.core(dtype="float32")
    assert run_tokens(core, PAIR_JOBS, tokenizer=direct.tokenizer) == run_tokens(direct, PAIR_JOBS)


def test_a_handoff_carries_the_levels(case, alone):
    """A prefill node's handoff carries each image's rows with their DeepStack levels (64 x 3 wide); the decode node
    continues it bitwise, imported or re-prefilled from the carried rows, never running its tower."""
    import asyncio
    from types import SimpleNamespace

    from conveyor.cluster import wire
    from conveyor.cluster.decode import DecodeNode
    from conveyor.cluster.prefill import handoff_frame
    from conveyor.config import ClusterConfig
    from conveyor.engine.kv_transfer import KVBlob

    prefill, decode = case.core(), case.core()
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
        request = prefill.make_request(prefill.tokenizer.encode(text, add_special_tokens=False), case.params, name,
                                       images=images)
        prefill.kv_transfer.mark_for_handoff(name)
        prefill.add_request(request)
        handoff = None
        while handoff is None:
            handoff = next((o.kv_handoff for o in prefill.step() if o.kv_handoff is not None), None)
        frame = wire.decode(wire.encode(handoff_frame(handoff, None))[wire.HEADER.size:])
        assert all(span.hidden == 64 * 3 for span in frame.images)
        got = asyncio.run(take(frame, recompute))
        assert got.output_token_ids == tokens(alone[job]), job
    assert decode.runner.encoder_cache.num_encoded == 0
    assert decode.kv_transfer.stats.num_imported == 2
    for core in (prefill, decode):
        check_no_leak(core)
