"""DeepSeek-V3 GGUF files as llama.cpp's converter writes them (`deepseek2`: kv_b_proj split per head into attn_k_b,
transposed, and attn_v_b; experts stacked; rotary rows left interleaved) load to what the HF directory loads to."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
import transformers

from conveyor.config import kernel_settings_from_env
from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.kernels import cpu_backend
from conveyor.loading import load_checkpoint
from conveyor.loading.checkpoint import LoadError, QuantizedTensor
from conveyor.loading.gguf_loader import BLOCK_TENSORS, GLOBAL_TENSORS
from conveyor.models.deepseek_v3 import GGUF_TENSORS
from conveyor.testing import add_tiny_bpe_vocab

Q = gguf.GGMLQuantizationType
# Widths that are whole Q8_0 blocks wherever a matrix is quantized (q_lora 64, latent 32, heads' v 32).
TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            routed_scaling_factor=2.5, q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, v_head_dim=32,
            qk_nope_head_dim=32, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
            max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
_NAMES = {hf: g for g, hf in {**BLOCK_TENSORS, **GGUF_TENSORS}.items()}


def _hf_model() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**TINY)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif "experts" in name or "self_attn" in name:
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    return model


def _gguf_name(hf_name: str) -> str:
    """`model.layers.1.self_attn.q_a_proj.weight` -> `blk.1.attn_q_a.weight` (llama.cpp's names)."""
    if hf_name.endswith("e_score_correction_bias"):
        return f"blk.{hf_name.split('.')[2]}.exp_probs_b.bias"
    base, _, suffix = hf_name.rpartition(".")
    for gguf_base, hf_base in GLOBAL_TENSORS.items():
        if base == hf_base:
            return f"{gguf_base}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}.{suffix}"


def _write_gguf(path, model, qtype: Q = Q.F32, gating: gguf.ExpertGatingFuncType = gguf.ExpertGatingFuncType.SIGMOID,
                legacy: bool = False, yarn: dict | None = None) -> None:
    """As convert_hf_to_gguf's DeepseekV2Model does; matrices whose rows are whole blocks in `qtype`. `legacy`: as
    converters before the MLA split wrote it (whole attn_kv_b, per-head key/value lengths, no *_mla keys)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(1)  # MLA as MQA over the latent
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    if legacy:
        writer.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        writer.add_value_length(cfg.v_head_dim)
    else:
        writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        writer.add_value_length(cfg.kv_lora_rank)
        writer.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        writer.add_value_length_mla(cfg.v_head_dim)
    if yarn:  # as the converter writes a YaRN rope_scaling (0.1 * mscale_all_dim: llama.cpp's legacy log mul)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(yarn["factor"])
        writer.add_rope_scaling_orig_ctx_len(yarn["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * yarn["mscale_all_dim"])
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    writer.add_expert_weights_norm(True)
    writer.add_expert_group_count(cfg.n_group)
    writer.add_expert_group_used_count(cfg.topk_group)
    writer.add_expert_gating_func(gating)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    add_tiny_bpe_vocab(writer)
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("kv_b_proj.weight") and legacy:
            _add(writer, f"blk.{layer}.attn_kv_b.weight", array, qtype)
        elif name.endswith("kv_b_proj.weight"):  # split per head; k_b transposed to (H, L, N)
            kv_b = array.reshape(heads, nope + v, -1)
            k_b = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))
            _add(writer, f"blk.{layer}.attn_k_b.weight", k_b, qtype)
            _add(writer, f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:]), qtype)
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # transformers 5 keeps them stacked
            if name.endswith("gate_up_proj"):
                gate, up = np.split(array, 2, axis=1)
                _add(writer, f"blk.{layer}.ffn_gate_exps.weight", gate, qtype)
                _add(writer, f"blk.{layer}.ffn_up_exps.weight", up, qtype)
            else:
                _add(writer, f"blk.{layer}.ffn_down_exps.weight", array, qtype)
        elif name.endswith("mlp.gate.weight"):
            writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", array)
        else:
            _add(writer, _gguf_name(name), array, qtype if array.ndim == 2 else Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add(writer: gguf.GGUFWriter, name: str, array: np.ndarray, qtype: Q) -> None:
    if qtype == Q.F32 or array.shape[-1] % 32:
        writer.add_tensor(name, array)
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


@pytest.fixture
def hf_dir(tmp_path, copy_tokenizer):
    model = _hf_model()
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    copy_tokenizer(folder)
    return model, load_checkpoint(str(folder))


PROMPTS = [[3 + (7 * i + 5 * j) % 90 for j in range(5 + 3 * i)] for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _tokens(checkpoint, **flags) -> list[list[int]]:
    llm = LLM(checkpoint=checkpoint, parallel=4, kv_cache_budget="none", **flags)
    return [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]


def test_f32_gguf_runs_what_the_hf_directory_does(tmp_path, hf_dir) -> None:
    model, want = hf_dir
    path = tmp_path / "tiny-deepseek.gguf"
    _write_gguf(path, model)
    got = load_checkpoint(str(path))
    fields = ("architecture", "mla", "num_key_value_heads", "head_dim", "attention_scale", "num_experts",
              "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "moe_scoring", "moe_expert_bias",
              "moe_num_groups", "moe_topk_groups", "routed_scaling_factor", "shared_expert_intermediate_size",
              "dense_mlp_layers", "intermediate_size")
    assert {f: getattr(got.config, f) for f in fields} == {f: getattr(want.config, f) for f in fields}
    # kv_b_proj arrives split per head: k_b (H * L, N), v_b (H * V, L)
    kv_b = want.weights["model.layers.2.self_attn.kv_b_proj.weight"].view(4, 32 + 32, 32)
    assert torch.equal(got.weights["model.layers.2.self_attn.k_b_proj.weight"],
                       kv_b[:, :32].transpose(1, 2).reshape(4 * 32, 32))
    assert torch.equal(got.weights["model.layers.2.self_attn.v_b_proj.weight"], kv_b[:, 32:].reshape(4 * 32, 32))
    shared = set(got.weights) & set(want.weights)
    assert len(set(got.weights) - shared) == 6 and len(set(want.weights) - shared) == 3  # k_b, v_b vs kv_b
    for name in shared:
        assert torch.equal(got.weights[name], want.weights[name]), name
    hf_tokens = _tokens(dataclasses.replace(want, tokenizer=got.tokenizer), dtype="float32")
    assert _tokens(got, dtype="float32") == hf_tokens
    assert len({tuple(t) for t in hf_tokens}) > 1


@pytest.mark.skipif(not cpu_backend(kernel_settings_from_env()).runs_quantized(Q.Q8_0), reason="no quantized kernel")
def test_q8_0_gguf_keeps_per_head_blocks_and_matches_the_hf_directory_quantized_at_load(tmp_path, hf_dir) -> None:
    model, want = hf_dir
    path = tmp_path / "tiny-deepseek.Q8_0.gguf"
    _write_gguf(path, model, Q.Q8_0)
    got = load_checkpoint(str(path))
    assert isinstance(got.weights["model.layers.0.self_attn.k_b_proj.weight"], QuantizedTensor)
    quantized = LLM(checkpoint=got, parallel=4, kv_cache_budget="none")
    attn = quantized.engine.runner.model.layers[0].self_attn
    assert all(linear.segments for linear in (*attn.k_absorb.heads, *attn.v_up.heads))  # each head's blocks
    tokens = [r.token_ids for r in quantized.generate(PROMPTS, GREEDY)]
    # The HF directory quantized to Q8_0 at load holds the same blocks, head by head: the same tokens.
    assert tokens == _tokens(dataclasses.replace(want, tokenizer=got.tokenizer), weight_dtype="q8_0")


def test_softmax_routing_is_refused(tmp_path, hf_dir) -> None:
    path = tmp_path / "tiny-deepseek-v2-routing.gguf"
    _write_gguf(path, hf_dir[0], gating=gguf.ExpertGatingFuncType.SOFTMAX)  # DeepSeek-V2's
    with pytest.raises(LoadError, match="sigmoid"):
        load_checkpoint(str(path))


def test_legacy_gguf_with_a_whole_kv_b_runs_what_the_hf_directory_does(tmp_path, hf_dir) -> None:
    model, want = hf_dir
    path = tmp_path / "tiny-deepseek-legacy.gguf"
    _write_gguf(path, model, legacy=True)
    got = load_checkpoint(str(path))
    assert got.config.mla == want.config.mla and got.config.attention_scale == want.config.attention_scale
    assert torch.equal(got.weights["model.layers.1.self_attn.kv_b_proj.weight"],
                       want.weights["model.layers.1.self_attn.kv_b_proj.weight"])
    assert (_tokens(got, dtype="float32")
            == _tokens(dataclasses.replace(want, tokenizer=got.tokenizer), dtype="float32"))


def test_yarn_gguf_gets_the_softmax_mscale(tmp_path) -> None:
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.DeepseekV3Config(**TINY, rope_parameters=yarn)).eval()
    path = tmp_path / "tiny-deepseek-yarn.gguf"
    _write_gguf(path, model, yarn=yarn)
    cfg = load_checkpoint(str(path)).config
    assert cfg.attention_scale == pytest.approx(model.model.layers[0].self_attn.scaling, rel=1e-6)
    assert cfg.attention_scale > 48 ** -0.5 * 1.5  # mscale(40, 1)^2 = 1.87
    assert cfg.rope_scaling["mscale"] == cfg.rope_scaling["mscale_all_dim"] == pytest.approx(1.0)
