"""Qwen3-VL-MoE (`qwen3_vl_moe`: Qwen3-VL's tower and DeepStack over a Qwen3-MoE text model whose routers always
renormalise) against transformers (fp32): prefill logits and greedy tokens with 1 and 2 images; the Hub's transposed
expert stacks load as transformers 5's saved ones; through the engine 16 concurrent image requests == one at a time
bitwise (also with a 3-token chunk budget); the qwen3vlmoe text GGUF + mmproj == the directory's greedy tokens."""

from __future__ import annotations

import pytest
import torch
from test_qwen3_vl_vs_hf import PROMPTS, _logits, _runner
from tiny_qwen3_vl import IMAGE, random_image, write_model_dir
from vision_harness import EngineCase, gguf_pair_core, run_tokens, tokens

from conveyor.engine.sampling_params import SamplingParams
from conveyor.multimodal.image_input import ImageInput

transformers = pytest.importorskip("transformers")
PAD = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conveyor.loading.hf_loader import load_hf_dir
    from conveyor.multimodal.vision import build_vision

    path = tmp_path_factory.mktemp("qwen3_vl_moe")
    hf = write_model_dir(path, transformers, moe=True)
    checkpoint = load_hf_dir(str(path))
    assert checkpoint.vision.model_type == "qwen3_vl_moe"
    assert checkpoint.config.architecture == "qwen3_vl_moe_text" and checkpoint.config.num_experts == 4
    assert checkpoint.config.dense_mlp_layers == (1,) and checkpoint.config.norm_topk_prob
    vision = build_vision(checkpoint.vision, checkpoint.tokenizer, torch.float32, torch.device("cpu"))
    assert vision.num_levels == 2
    return hf, checkpoint, vision, str(path)


@pytest.mark.parametrize("num_images", [1, 2])
def test_prefill_logits_and_greedy_match_transformers(tiny, num_images):
    hf, checkpoint, vision, _ = tiny
    images = [random_image(40 + 19 * s, 30 + 7 * s, 10 + s) for s in range(num_images)]
    got = vision.processor.expand(PROMPTS[num_images], [ImageInput.from_pil(i) for i in images])
    ids = torch.tensor([got.token_ids])
    pixels = torch.cat([item.pixel_values for item in got.items])
    grid = torch.tensor([[1, item.extras["grid_h"], item.extras["grid_w"]] for item in got.items])
    want = dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).int())
    runner = _runner(checkpoint, vision)
    table = list(range(250, 0, -1))
    ours = _logits(runner, got.token_ids, got, 0, table)
    with torch.no_grad():
        expected = hf(**want).logits[0]
        generated = hf.generate(**want, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    assert expected.abs().max() > 2
    torch.testing.assert_close(ours, expected, atol=1e-3, rtol=1e-4)
    tokens, last = list(got.token_ids), ours[-1]
    for _ in range(6):
        tokens.append(int(last.argmax()))
        last = _logits(runner, tokens[-1:], got, len(tokens) - 1, table)[-1]
    assert tokens[len(got.token_ids):][:len(generated)] == generated


def test_engine_concurrent_equals_one_at_a_time(tiny):
    *_, model_dir = tiny
    images = [ImageInput.from_pil(random_image(30 + 11 * seed, 40, seed)) for seed in range(4)]
    jobs = [(f"<|im_start|>user\n{PAD}Describe picture {i}.<|im_end|>\n", [images[i % 4]]) for i in range(15)]
    jobs.append((f"<|im_start|>two{PAD}{PAD}\nSame?<|im_end|>\n", [images[1], images[3]]))
    case = EngineCase(model_dir, jobs, images, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0))
    alone = case.alone()
    assert len({tuple(tokens(a)) for a in alone[:4]}) > 1
    case.check_concurrent(alone)
    case.check_chunk_budget(alone)


def test_the_hubs_transposed_experts_load_the_same(tiny, tmp_path):
    """The Hub's files keep the stacked experts inputs first, (E, hidden, 2I) / (E, I, hidden): the same model."""
    import shutil

    from safetensors.torch import load_file, save_file

    from conveyor.loading.hf_loader import load_hf_dir

    hf, checkpoint, vision, model_dir = tiny
    hub = tmp_path / "hub"
    shutil.copytree(model_dir, hub)
    (shard,) = hub.glob("*.safetensors")
    weights = load_file(shard)
    swapped = {k: v.transpose(1, 2).contiguous() if ".experts." in k else v for k, v in weights.items()}
    assert any(".experts." in k for k in weights)
    save_file(swapped, shard, metadata={"format": "pt"})
    hub_checkpoint = load_hf_dir(str(hub))
    got = vision.processor.expand(PROMPTS[1], [ImageInput.from_pil(random_image(50, 40, 3))])
    table = list(range(250, 0, -1))
    assert torch.equal(_logits(_runner(hub_checkpoint, vision), got.token_ids, got, 0, table),
                       _logits(_runner(checkpoint, vision), got.token_ids, got, 0, table))


def test_gguf_text_and_mmproj(tiny, tmp_path):
    """llama-server's pair: the qwen3vlmoe text GGUF + the qwen3vl_merger mmproj == the directory's greedy tokens."""
    from tiny_qwen3_vl import write_mmproj, write_text_gguf

    hf, _, _, model_dir = tiny
    write_mmproj(tmp_path / "mmproj.gguf", hf)
    write_text_gguf(tmp_path / "text.gguf", hf)
    pair = gguf_pair_core(str(tmp_path / "text.gguf"), str(tmp_path / "mmproj.gguf"), parallel=4)
    assert pair.model_config.architecture == "qwen3_vl_moe_text" and pair.vision.model_type == "qwen3_vl_moe"
    direct = EngineCase(model_dir, [], []).core(parallel=4, dtype="float32")
    images = [ImageInput.from_pil(random_image(w, h, seed)) for seed, (w, h) in enumerate([(64, 48), (48, 64)])]
    jobs = [(f"<|im_start|>user\n{PAD}Describe.<|im_end|>\n", [image]) for image in images]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert run_tokens(pair, jobs, params, direct.tokenizer) == run_tokens(direct, jobs, params)
