"""Gemma 3's vision side against transformers (float32): the processor's pixels and token ids, the tower +
projector's embeddings, then prefill logits and greedy tokens with 1 and 2 images through our runner."""

import pytest
import torch
from tiny_gemma3_vision import BOI, NUM_EMBEDS, SOFT, hf_processor, random_image, write_model_dir

from conveyor.loading.hf_loader import load_hf_dir
from conveyor.multimodal.image_input import ImageInput
from conveyor.multimodal.vision import build_vision

transformers = pytest.importorskip("transformers")

PROMPTS = {  # newline runs beside the marker merge into one token on both sides
    1: "<bos><start_of_turn>user\n<start_of_image>What is this?<end_of_turn>\n<start_of_turn>model\n",
    2: "<bos><start_of_turn>user\nabc<start_of_image><start_of_image>\nCompare them, please, in detail.<end_of_turn>\n"
       "<start_of_turn>model\n",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_vision")
    hf = write_model_dir(path, transformers)
    checkpoint = load_hf_dir(str(path))
    vision = build_vision(checkpoint.vision, checkpoint.tokenizer, torch.float32, torch.device("cpu"))
    return hf, checkpoint, vision


def _ours(checkpoint, vision, text: str, images: list):
    ids = checkpoint.tokenizer.encode(text, add_special_tokens=False)
    return vision.processor.expand(ids, [ImageInput.from_pil(i) for i in images])


@pytest.mark.parametrize("num_images", [1, 2])
def test_processor_matches_transformers(tiny, num_images):
    _, checkpoint, vision = tiny
    images = [random_image(s, (40 + 7 * s, 50)) for s in range(num_images)]
    want = hf_processor(transformers)(text=[PROMPTS[num_images]], images=[images], return_tensors="pt")
    got = _ours(checkpoint, vision, PROMPTS[num_images], images)
    assert got.token_ids == want["input_ids"][0].tolist()
    assert torch.equal(torch.stack([item.pixel_values for item in got.items]), want["pixel_values"])
    types = [0] * len(got.token_ids)
    for item in got.items:
        for p in item.embed_positions():
            types[p] = 1
            assert got.token_ids[p] == SOFT
        assert got.token_ids[item.offset + item.embed_runs[0][0] - 1] == BOI
    assert types == want["token_type_ids"][0].tolist()


def test_marker_count_must_match_images(tiny):
    from conveyor.errors import InvalidRequestError

    _, checkpoint, vision = tiny
    with pytest.raises(InvalidRequestError, match="2 image markers"):
        _ours(checkpoint, vision, PROMPTS[2], [random_image(0)])


def test_encoder_matches_transformers(tiny):
    hf, checkpoint, vision = tiny
    images = [random_image(3), random_image(4, (64, 20))]
    got = _ours(checkpoint, vision, PROMPTS[2], images)
    with torch.no_grad():
        want = hf.model.get_image_features(torch.stack([i.pixel_values for i in got.items])).pooler_output
    for item, expected in zip(got.items, want):
        ours = vision.encoder.encode(item)
        assert ours.shape == (NUM_EMBEDS, 64)
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_bf16_tower_on_the_kernels_is_close_and_repeatable(tiny):
    """The engine's tower: bf16 with the backend's dense attention (csrc/dense_attention.h's AMX path on an AMX
    CPU): within bf16 rounding of the fp32 tower, and the same bits on every encode (the prefix cache keys on it)."""
    from conveyor.config import kernel_settings_from_env
    from conveyor.kernels import cpu_backend

    _, checkpoint, vision = tiny
    ops = cpu_backend(kernel_settings_from_env())
    bf16 = build_vision(checkpoint.vision, checkpoint.tokenizer, torch.bfloat16, torch.device("cpu"), ops=ops)
    assert all(layer.ops is ops for layer in bf16.encoder.layers)
    item = _ours(checkpoint, vision, PROMPTS[1], [random_image(5)]).items[0]
    got = bf16.encoder.encode(item)
    assert got.dtype == torch.bfloat16 and torch.equal(bf16.encoder.encode(item), got)
    want = vision.encoder.encode(item)
    assert (got.float() - want).abs().max() <= 0.05 * want.abs().max()


def test_layer_buffers_and_the_fused_qkv_change_no_bits(tiny):
    """A layer with an encode's shared buffers (outputs in place) == without; q, k, v run as one GEMM over views of one
    matrix, and weights loaded after an encode are the ones the next encode uses."""
    from conveyor.multimodal.gemma3 import Gemma3VisionEncoder, SiglipBuffers

    _, checkpoint, vision = tiny
    layer = vision.encoder.layers[0]
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # as encode() runs it
        plain = layer(x)
        assert torch.equal(layer(x.clone(), SiglipBuffers.like(x, layer.fc1.out_features)), plain)
    weight, _ = layer._qkv
    assert layer.k_proj.weight.data_ptr() == weight[32:].data_ptr()
    item = _ours(checkpoint, vision, PROMPTS[1], [random_image(6)]).items[0]
    state = {k: v * 1.5 if k.endswith(("q_proj.weight", "v_proj.bias")) else v.clone()
             for k, v in vision.encoder.state_dict().items()}
    fresh = Gemma3VisionEncoder(checkpoint.vision.config)
    fresh.load_state_dict(state, assign=True)
    first = vision.encoder.encode(item)
    try:
        vision.encoder.load_state_dict(state, assign=True)
        again = vision.encoder.encode(item)
        assert not torch.equal(again, first) and torch.equal(again, fresh.eval().encode(item))
    finally:
        vision.encoder.load_state_dict({k: v / 1.5 if k.endswith(("q_proj.weight", "v_proj.bias")) else v
                                        for k, v in state.items()}, assign=True)


def _runner(checkpoint, vision):
    from conveyor.models.registry import build_model
    from conveyor.multimodal.encoder_cache import EncoderCache
    from conveyor.runner.model_runner import ModelRunner

    model = build_model(checkpoint.config, checkpoint.weights, torch.float32, torch.device("cpu"),
                        batch_invariant=False)
    return ModelRunner(model, checkpoint.config, num_blocks=64, block_size=4, dtype=torch.float32,
                       device=torch.device("cpu"), ops=model.ops, encoder_cache=EncoderCache(vision.encoder))


def _logits(runner, token_ids, items, start, table):
    from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
    from conveyor.engine.sampling_params import SamplingParams

    end = start + len(token_ids)
    chunk = ScheduledChunk("r", token_ids, start, table, True, SamplingParams(temperature=0),
                           images=tuple(i for i in items if i.offset < end and i.end > start))
    inputs = runner.prepare_inputs(SchedulerOutput(chunks=[chunk]))
    return runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta,
                        torch.arange(len(token_ids)), **inputs.model_kwargs())


@pytest.mark.parametrize("num_images", [1, 2])
def test_prefill_logits_and_greedy_match_transformers(tiny, num_images):
    """Image rows attend their run both ways (transformers' token_type_ids mask), also past the sliding window."""
    hf, checkpoint, vision = tiny
    images = [random_image(10 + s) for s in range(num_images)]
    want = hf_processor(transformers)(text=[PROMPTS[num_images]], images=[images], return_tensors="pt")
    got = _ours(checkpoint, vision, PROMPTS[num_images], images)
    runner = _runner(checkpoint, vision)
    table = list(range(40, 0, -1))  # scattered blocks
    ours = _logits(runner, got.token_ids, got.items, 0, table)
    with torch.no_grad():
        expected = hf(**want).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    # greedy continuation through our paged cache == transformers' generate
    with torch.no_grad():
        generated = hf.generate(**want, max_new_tokens=6, do_sample=False)[0, len(got.token_ids):].tolist()
    tokens, last = list(got.token_ids), ours[-1]
    for _ in range(6):
        tokens.append(int(last.argmax()))
        last = _logits(runner, tokens[-1:], got.items, len(tokens) - 1, table)[-1]
    assert tokens[len(got.token_ids):] == generated


def test_causal_image_rows_would_differ(tiny):
    """The bidirectional mask matters here: plain causal image rows give other logits (so the test above sees it)."""
    hf, checkpoint, vision = tiny
    images = [random_image(10)]
    got = _ours(checkpoint, vision, PROMPTS[1], images)
    runner = _runner(checkpoint, vision)
    bidirectional = _logits(runner, got.token_ids, got.items, 0, list(range(1, 41)))
    from dataclasses import replace

    causal = [replace(item, bidirectional=False) for item in got.items]
    plain = _logits(runner, got.token_ids, causal, 0, list(range(1, 41)))
    assert not torch.allclose(bidirectional[-1], plain[-1], atol=1e-3)


def test_a_prefill_resumed_inside_an_image_run_matches(tiny):
    """A prefix hit may end inside an image run (its cached rows saw the whole run): the rest of the run, in one
    chunk with key_end at the run's end, gives the logits of the whole prompt in one forward."""
    hf, checkpoint, vision = tiny
    got = _ours(checkpoint, vision, PROMPTS[1], [random_image(10)])
    runner = _runner(checkpoint, vision)
    table = list(range(1, 41))
    whole = _logits(runner, got.token_ids, got.items, 0, table)
    lo, n = got.items[0].embed_runs[0]
    middle = got.items[0].offset + lo + n // 2  # the K/V before it stay in the blocks from the first forward
    resumed = _logits(runner, got.token_ids[middle:], got.items, middle, table)
    torch.testing.assert_close(resumed, whole[middle:], atol=1e-5, rtol=1e-5)
