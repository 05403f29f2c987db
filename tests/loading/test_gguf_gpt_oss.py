"""A GPT-OSS GGUF laid out as llama.cpp's converter writes it (conversion/gpt_oss.py: gate_up split from its
interleave into ffn_gate_exps / ffn_up_exps with their biases, experts transposed to (E, N, K), attn_sinks.weight,
post_attention_norm) loads to what the same model's Hugging Face directory loads to; Q8_0 experts run as blocks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from tiny_checkpoints import gguf_name, gguf_writer

from conveyor.config import kernel_settings_from_env
from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.kernels import cpu_backend
from conveyor.loading import load_checkpoint
from conveyor.loading.checkpoint import QuantizedTensor
from conveyor.structured.harmony import template_is_harmony
from conveyor.testing import add_tiny_bpe_vocab

Q = gguf.GGMLQuantizationType
ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}


def _hf_model() -> transformers.PreTrainedModel:
    cfg = transformers.GptOssConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=32, intermediate_size=64, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=6, max_position_embeddings=512,
                                    rms_norm_eps=1e-6, rope_parameters=dict(ROPE))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("sinks"):
                p.normal_()
            elif "router" in name:
                p.normal_(0, 0.5)  # rows pick different experts
            elif "experts" in name or name.endswith("bias") or "embed" in name or "proj" in name:
                p.normal_(0, 0.2)  # transformers' 0.02 init gives one token for every prompt
    return model


def _write_gguf(path, model, qtype: Q = Q.F32, chat_template: str | None = None) -> None:
    """As convert_hf_to_gguf's GptOssModel does for non-MXFP4 checkpoints; matrices in `qtype`, the rest F32."""
    cfg = model.config
    writer = gguf_writer(path, "gpt-oss", cfg, ROPE["rope_theta"])
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.intermediate_size)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(ROPE["factor"])
    writer.add_rope_scaling_orig_ctx_len(ROPE["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(ROPE["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(ROPE["beta_slow"])
    add_tiny_bpe_vocab(writer)
    writer.add_tokenizer_pre("gpt-4o")  # o200k, as _set_vocab_gpt2 names it
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, tensor in model.state_dict().items():
        array, blk = tensor.float().numpy(), f"blk.{name.split('.')[2]}" if ".layers." in name else ""
        if name.endswith("experts.gate_up_proj"):  # (E, H, 2I) -> (E, 2I, H), then gate rows ::2, up rows 1::2
            rows = array.transpose(0, 2, 1)
            _add(writer, f"{blk}.ffn_gate_exps.weight", np.ascontiguousarray(rows[:, ::2]), qtype)
            _add(writer, f"{blk}.ffn_up_exps.weight", np.ascontiguousarray(rows[:, 1::2]), qtype)
        elif name.endswith("experts.gate_up_proj_bias"):
            writer.add_tensor(f"{blk}.ffn_gate_exps.bias", np.ascontiguousarray(array[:, ::2]))
            writer.add_tensor(f"{blk}.ffn_up_exps.bias", np.ascontiguousarray(array[:, 1::2]))
        elif name.endswith("experts.down_proj"):
            _add(writer, f"{blk}.ffn_down_exps.weight", np.ascontiguousarray(array.transpose(0, 2, 1)), qtype)
        elif name.endswith("experts.down_proj_bias"):
            writer.add_tensor(f"{blk}.ffn_down_exps.bias", array)
        elif ".mlp.router." in name:
            writer.add_tensor(f"{blk}.ffn_gate_inp.{name.rsplit('.', 1)[1]}", array)
        elif name.endswith("self_attn.sinks"):
            writer.add_tensor(f"{blk}.attn_sinks.weight", array)
        elif name.endswith("post_attention_layernorm.weight"):  # ATTN_POST_NORM for gpt-oss
            writer.add_tensor(f"{blk}.post_attention_norm.weight", array)
        else:
            _add(writer, gguf_name(name), array, qtype if array.ndim == 2 else Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add(writer: gguf.GGUFWriter, name: str, array: np.ndarray, qtype: Q) -> None:
    if qtype in (Q.F32, Q.F16):
        writer.add_tensor(name, array.astype(np.float16 if qtype == Q.F16 else np.float32))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


@pytest.fixture
def hf_dir(tmp_path, copy_tokenizer):
    model = _hf_model()
    folder = tmp_path / "gpt_oss"
    model.save_pretrained(folder)
    copy_tokenizer(folder)
    return model, load_checkpoint(str(folder))


FIELDS = ("architecture", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim", "num_key_value_heads",
          "rms_norm_eps", "rope_theta", "rope_scaling", "attention_bias", "attention_out_bias", "attention_sinks",
          "sliding_window", "layer_types", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
          "norm_topk_prob", "dense_mlp_layers", "moe_scoring", "moe_linear_bias", "moe_activation", "swiglu_alpha",
          "swiglu_limit")


def test_f32_gguf_loads_what_the_hf_directory_does(tmp_path, hf_dir) -> None:
    model, want = hf_dir
    path = tmp_path / "tiny-gpt-oss.gguf"
    _write_gguf(path, model)
    got = load_checkpoint(str(path))
    got_fields, want_fields = ({f: getattr(c.config, f) for f in FIELDS} for c in (got, want))
    # HF's rope dict also keeps rope_type's spelling and beta defaults; the values that shape the rotary agree
    assert {k: got_fields["rope_scaling"][k] for k in got_fields["rope_scaling"]} == {
        k: want_fields["rope_scaling"][k] for k in got_fields["rope_scaling"]}
    got_fields.pop("rope_scaling"), want_fields.pop("rope_scaling")
    assert got_fields == want_fields
    assert set(got.weights) == set(want.weights)
    for name, weight in want.weights.items():  # experts split from their stacks and their interleave
        assert torch.equal(got.weights[name], weight), name


def test_f16_gguf_holds_the_hf_directory_matrices_rounded_to_f16(tmp_path, hf_dir) -> None:
    model, want = hf_dir
    path = tmp_path / "tiny-gpt-oss.F16.gguf"
    _write_gguf(path, model, Q.F16)
    got = load_checkpoint(str(path))
    assert set(got.weights) == set(want.weights)
    for name, weight in want.weights.items():  # matrices F16 (the router F32, as the converter keeps it), rest F32
        matrix = weight.dim() == 2 and ".router." not in name
        assert got.weights[name].dtype == (torch.float16 if matrix else torch.float32), name
        assert torch.equal(got.weights[name], weight.half() if matrix else weight), name


@pytest.mark.skipif(not cpu_backend(kernel_settings_from_env()).runs_quantized(Q.Q8_0), reason="no quantized kernel")
def test_q8_0_experts_run_as_blocks_and_match_the_hf_directory(tmp_path, hf_dir) -> None:
    model, want = hf_dir
    path = tmp_path / "tiny-gpt-oss.Q8_0.gguf"
    _write_gguf(path, model, Q.Q8_0)
    got = load_checkpoint(str(path))
    expert = got.weights["model.layers.1.mlp.experts.3.down_proj.weight"]
    assert isinstance(expert, QuantizedTensor) and expert.shape == (64, 64)
    down = want.weights["model.layers.1.mlp.experts.3.down_proj.weight"].numpy()
    assert np.array_equal(expert.dequantize().numpy(), gguf.quants.dequantize(gguf.quants.quantize(down, Q.Q8_0),
                                                                              Q.Q8_0))
    # The HF directory quantized to Q8_0 at load holds the same blocks (router and biases dense in both): same tokens.
    llm = _same_tokens(got, want, "bfloat16", weight_dtype="q8_0")
    assert llm.engine.runner.model.layers[0].mlp.experts[2].down_proj.segments  # ran as packed blocks


def _same_tokens(got, want, dtype: str, **reference_kwargs) -> LLM:
    ours = LLM(checkpoint=got, parallel=4, dtype=dtype, kv_cache_budget="none")
    reference = LLM(checkpoint=dataclasses.replace(want, tokenizer=got.tokenizer), parallel=4, dtype=dtype,
                    kv_cache_budget="none", **reference_kwargs)
    prompts = [[3 + (7 * i + 5 * j) % 90 for j in range(5 + 3 * i)] for i in range(4)]  # longer than the window
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = [r.token_ids for r in ours.generate(prompts, params)]
    assert tokens == [r.token_ids for r in reference.generate(prompts, params)]
    assert len({tuple(t) for t in tokens}) > 1
    return ours


def test_mxfp4_experts_load_through_the_quantized_path(tmp_path, hf_dir) -> None:
    """Real gpt-oss files keep experts in MXFP4: they load as GGML blocks (run natively where the kernels have the
    type, else dequantized at load); in float32 the tokens are the HF directory's with those experts dequantized."""
    model, want = hf_dir
    path = tmp_path / "tiny-gpt-oss.MXFP4.gguf"
    _write_gguf(path, model, Q.MXFP4)
    got = load_checkpoint(str(path))
    rounded = dict(want.weights)
    for name, weight in want.weights.items():
        blocks = got.weights[name]
        if ".experts." in name and name.endswith(".weight"):
            assert isinstance(blocks, QuantizedTensor) and blocks.qtype == Q.MXFP4, name
            dequantized = gguf.quants.dequantize(gguf.quants.quantize(weight.numpy(), Q.MXFP4), Q.MXFP4)
            assert np.array_equal(blocks.dequantize().numpy(), dequantized), name
        if isinstance(blocks, QuantizedTensor):  # every matrix but the router is MXFP4 in this file
            rounded[name] = blocks.dequantize()
    _same_tokens(got, dataclasses.replace(want, weights=rounded), "float32")


def test_o200k_split_and_the_harmony_template_from_metadata(tmp_path, hf_dir) -> None:
    model, _ = hf_dir
    template = (Path(__file__).parent.parent / "data" / "gpt_oss_chat_template.jinja").read_text()
    _write_gguf(tmp_path / "tiny.gguf", model, chat_template=template)
    tokenizer = load_checkpoint(str(tmp_path / "tiny.gguf")).tokenizer
    split = tokenizer.backend.pre_tokenizer.pre_tokenize_str("Hello, WORLD's world12345 it's")
    assert [piece.replace("\u0120", " ") for piece, _ in split] == [
        "Hello", ",", " WORLD's", " world", "123", "45", " it's"]  # contractions kept, digits in threes
    assert template_is_harmony(tokenizer.chat_template)
