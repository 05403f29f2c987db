"""MoE GGUF files laid out as llama.cpp's converter writes them (experts stacked in 3D tensors, Mixtral as
`llama` with q/k permuted) load to what the same model's Hugging Face directory loads to."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
import transformers
from tiny_checkpoints import gguf_name, gguf_writer, permute_for_llama_cpp

from conveyor.config import kernel_settings_from_env
from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.kernels import cpu_backend
from conveyor.loading import load_checkpoint
from conveyor.loading.checkpoint import QuantizedTensor
from conveyor.testing import add_tiny_bpe_vocab

Q = gguf.GGMLQuantizationType
TINY = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-6, num_experts_per_tok=2, tie_word_embeddings=False)
GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "llama4_text": "llama4"}
# Llama 4's shared expert, by llama.cpp's names
SHARED = {f"mlp.shared_expert.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")}


def _hf_model(family: str) -> transformers.PreTrainedModel:
    if family == "mixtral":
        cfg = transformers.MixtralConfig(**TINY, intermediate_size=96, num_local_experts=4)
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**TINY, intermediate_size=96, moe_intermediate_size=64, num_experts=4,
                                          norm_topk_prob=True)
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(**TINY, intermediate_size=64, num_experts=4)
    else:  # 4 layers: NoPE layer 3, MoE layers 1 and 3; llama.cpp's fixed chunk and temperature (the defaults)
        cfg = transformers.Llama4TextConfig(**{**TINY, "num_hidden_layers": 4, "num_experts_per_tok": 1},
                                            head_dim=16, intermediate_size=64, intermediate_size_mlp=96,
                                            num_local_experts=4, interleave_moe_layer_step=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_()
            elif name.endswith(("mlp.gate.weight", "router.weight")):
                p.normal_(0, 0.5)  # rows pick different experts
            elif "experts" in name:
                p.normal_(0, 0.2)
    return model


def _write_moe_gguf(path, family: str, model, qtype: Q = Q.F32, fuse_gate_up: bool = False,
                    expert_qtype: Q | None = None) -> None:
    """As convert_hf_to_gguf does: experts stacked (E, N, K), router and norms F32, Mixtral q/k permuted;
    the other matrices in `qtype`, the expert stacks in `expert_qtype` (default `qtype`); gate and up in one
    ffn_gate_up_exps with `fuse_gate_up`."""
    cfg, arch = model.config, GGUF_ARCH[family]
    expert_qtype = qtype if expert_qtype is None else expert_qtype
    llama4 = family == "llama4_text"
    # Llama 4's converter writes intermediate_size_mlp as feed_forward_length, intermediate_size as the experts'
    shape_cfg = dataclasses.replace(cfg, intermediate_size=cfg.intermediate_size_mlp) if llama4 else cfg
    writer = gguf_writer(path, arch, shape_cfg, cfg.rope_parameters["rope_theta"])
    writer.add_expert_count(cfg.num_local_experts if family in ("mixtral", "llama4_text") else cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if family == "qwen3_moe":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if llama4:
        writer.add_expert_feed_forward_length(cfg.intermediate_size)
        writer.add_interleave_moe_layer_step(cfg.interleave_moe_layer_step)
    add_tiny_bpe_vocab(writer)
    for name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        if llama4:  # feed_forward.* as mlp.*; stacked experts inputs-first, transposed as the converter does
            name = name.replace(".feed_forward.", ".mlp.")
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                array = np.ascontiguousarray(array.transpose(0, 2, 1))
            if name.endswith("mlp.router.weight"):
                name = name.replace("mlp.router.weight", "mlp.gate.weight")
            shared = next((SHARED[k] for k in SHARED if name.endswith(k)), None)
            if shared:
                _add(writer, f"blk.{name.split('.')[2]}.{shared}", array, qtype)
                continue
        if name.endswith("experts.gate_up_proj"):  # transformers 5 keeps gate|up fused: (E, 2I, H)
            layer = name.split(".")[2]
            if fuse_gate_up:
                _add(writer, f"blk.{layer}.ffn_gate_up_exps.weight", array, expert_qtype)
            else:
                gate, up = np.split(array, 2, axis=1)
                _add(writer, f"blk.{layer}.ffn_gate_exps.weight", gate, expert_qtype)
                _add(writer, f"blk.{layer}.ffn_up_exps.weight", up, expert_qtype)
        elif name.endswith("experts.down_proj"):
            _add(writer, f"blk.{name.split('.')[2]}.ffn_down_exps.weight", array, expert_qtype)
        elif name.endswith("mlp.gate.weight"):
            writer.add_tensor(f"blk.{name.split('.')[2]}.ffn_gate_inp.weight", array)
        else:
            if family == "mixtral" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
                array = permute_for_llama_cpp(tensor, heads).numpy()
            _add(writer, gguf_name(name), array, qtype if array.ndim == 2 else Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add(writer: gguf.GGUFWriter, name: str, array: np.ndarray, qtype: Q) -> None:
    if qtype == Q.F32:
        writer.add_tensor(name, array)
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


@pytest.fixture
def hf_dir(tmp_path, copy_tokenizer):
    def save(family: str):
        model = _hf_model(family)
        folder = tmp_path / family
        model.save_pretrained(folder)
        copy_tokenizer(folder)
        return model, load_checkpoint(str(folder))
    return save


@pytest.mark.parametrize(("family", "fuse_gate_up"), [("mixtral", False), ("qwen3_moe", True), ("olmoe", False),
                                                     ("llama4_text", False)])
def test_f32_gguf_loads_what_the_hf_directory_does(tmp_path, hf_dir, family: str, fuse_gate_up: bool) -> None:
    model, want = hf_dir(family)
    path = tmp_path / f"tiny-{family}.gguf"
    _write_moe_gguf(path, family, model, fuse_gate_up=fuse_gate_up)
    got = load_checkpoint(str(path))
    fields = ("architecture", "hidden_size", "num_hidden_layers", "head_dim", "qk_norm", "qk_norm_scope",
              "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "dense_mlp_layers",
              # Llama 4's
              "intermediate_size", "shared_expert_intermediate_size", "moe_scoring", "moe_weight_input",
              "no_rope_layers", "qk_l2_norm", "rope_interleaved", "attn_temperature_beta", "attn_temperature_length",
              "attn_temperature_offset", "attn_temperature_nope_only", "attention_chunk")
    assert {f: getattr(got.config, f) for f in fields} == {f: getattr(want.config, f) for f in fields}
    assert set(got.weights) == set(want.weights)
    for name, weight in want.weights.items():  # experts split from their stacks, Mixtral q/k un-permuted
        assert torch.equal(got.weights[name], weight), name


@pytest.mark.skipif(not cpu_backend(kernel_settings_from_env()).runs_quantized(Q.Q8_0), reason="no quantized kernel")
def test_q8_0_experts_run_as_blocks_and_match_the_hf_directory(tmp_path, hf_dir) -> None:
    model, want = hf_dir("mixtral")
    path = tmp_path / "tiny-mixtral.Q8_0.gguf"
    _write_moe_gguf(path, "mixtral", model, Q.Q8_0, fuse_gate_up=True)
    got = load_checkpoint(str(path))
    expert = got.weights["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    assert isinstance(expert, QuantizedTensor) and expert.shape == (64, 96)
    down = want.weights["model.layers.1.block_sparse_moe.experts.3.w2.weight"].numpy()
    assert np.array_equal(expert.dequantize().numpy(), gguf.quants.dequantize(gguf.quants.quantize(down, Q.Q8_0),
                                                                              Q.Q8_0))
    quantized = LLM(checkpoint=got, parallel=4, kv_cache_budget="none")
    assert quantized.engine.runner.model.layers[0].mlp.experts[2].down_proj.segments  # one packed linear each
    # The HF directory quantized to Q8_0 at load holds the same blocks (the router stays dense in both): same tokens.
    reference = LLM(checkpoint=dataclasses.replace(want, tokenizer=got.tokenizer), parallel=4, weight_dtype="q8_0",
                    kv_cache_budget="none")
    prompts = [[3 + (7 * i + 5 * j) % 90 for j in range(5 + 3 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert ([r.token_ids for r in quantized.generate(prompts, params)]
            == [r.token_ids for r in reference.generate(prompts, params)])


@pytest.mark.skipif(not cpu_backend(kernel_settings_from_env()).runs_quantized(Q.MXFP4), reason="no quantized kernel")
def test_mxfp4_experts_run_as_blocks(tmp_path, hf_dir) -> None:
    """GPT-OSS's layout: expert stacks in MXFP4, everything else float. The experts stay blocks (split from their
    stacks, packed for the quantized kernel), the MoE block is close to the same blocks dequantized, and greedy
    output does not depend on batch-mates."""
    model, want = hf_dir("mixtral")
    path = tmp_path / "tiny-mixtral.MXFP4.gguf"
    _write_moe_gguf(path, "mixtral", model, Q.F32, fuse_gate_up=True, expert_qtype=Q.MXFP4)
    got = load_checkpoint(str(path))
    expert = got.weights["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    assert isinstance(expert, QuantizedTensor) and expert.qtype == Q.MXFP4 and expert.shape == (64, 96)
    down = want.weights["model.layers.1.block_sparse_moe.experts.3.w2.weight"].numpy()
    assert np.array_equal(expert.dequantize().numpy(), gguf.quants.dequantize(gguf.quants.quantize(down, Q.MXFP4),
                                                                              Q.MXFP4))
    native = LLM(checkpoint=got, parallel=4, kv_cache_budget="none")
    moe = native.engine.runner.model.layers[1].mlp
    assert [s.type_name for s in moe.experts[2].gate_up_proj.segments] == ["MXFP4"]
    assert [s.type_name for s in moe.experts[2].down_proj.segments] == ["MXFP4"]
    assert not native.engine.runner.model.layers[1].self_attn.qkv_proj.segments  # float stays float
    dequantized = LLM(checkpoint=got, parallel=4, weight_dtype="bf16", kv_cache_budget="none")
    reference = dequantized.engine.runner.model.layers[1].mlp
    assert not reference.experts[2].down_proj.segments
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        y, y_ref = moe(x).float(), reference(x).float()
    # int8 activations per 32-block (docs/kernels.md), through two GEMMs and SwiGLU, rounded to bf16: measured
    # max |diff| 1.3-1.6% of max |y| over three inputs
    assert (y - y_ref).abs().max() <= 0.03 * y_ref.abs().max()
    prompts = [[3 + (7 * i + 5 * j) % 90 for j in range(5 + 3 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = [native.generate([p], params)[0].token_ids for p in prompts]
    assert [r.token_ids for r in native.generate(prompts, params)] == alone
