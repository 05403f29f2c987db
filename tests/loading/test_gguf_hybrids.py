"""LFM2, Qwen3.5 and their MoE variants (LFM2-MoE, Qwen3.5-MoE, Qwen3-Next) as GGUF files written as llama.cpp's
converter writes them (tiny_checkpoints.write_hybrid_gguf, which matched convert_hf_to_gguf's own output tensor
for tensor) load to what the same model's Hugging Face directory loads to: the same config, the same tensors
(quantized matrices, experts included, kept as GGML blocks), so the same logits."""

from __future__ import annotations

import dataclasses
import json
import logging

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_checkpoints import tiny_hf_hybrid, write_hybrid_gguf

from conveyor.engine.llm import LLM
from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.loading import LoadError, load_checkpoint
from conveyor.loading.checkpoint import QuantizedTensor, select_weights
from conveyor.models.config import ModelConfig
from conveyor.models.registry import build_model
from conveyor.models.weights import weight_bytes_by_format
from conveyor.runner.model_runner import ModelRunner
from conveyor.testing import random_mtp_weights

Q = gguf.GGMLQuantizationType
PROMPT = torch.randint(0, 128, (13,), generator=torch.Generator().manual_seed(1)).tolist()
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _round_to(model, qtype: Q) -> None:
    """Give the model's matrices the values the file holds, so its HF directory and the GGUF agree exactly."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (p.dim() == 2 or ".experts." in name) and qtype != Q.F32:  # experts: stacked (E, N, K), by rows
                blocks = gguf.quants.quantize(p.numpy(), qtype)
                p.copy_(torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, qtype), dtype=np.float32)))


def _hf_dir(model, tmp_path) -> tuple[ModelConfig, dict]:
    model.save_pretrained(tmp_path / "hf")
    config = ModelConfig.from_hf_dict(json.loads((tmp_path / "hf" / "config.json").read_text()))
    return config, select_weights(config, load_file(tmp_path / "hf" / "model.safetensors"), str(tmp_path))


def _split_like_gguf(config: ModelConfig, weights: dict) -> dict:
    """Qwen3-Next's HF in_proj_qkvz / in_proj_ba (rows per key head: q k v z, b a) as the split tensors its GGUF
    files hold (all q, all k, all v | z | b | a), as transformers' fix_query_key_value_ordering splits them."""
    if config.architecture != "qwen3_next":
        return weights
    out = dict(weights)
    nk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    group = config.linear_num_value_heads // nk
    for name in [n for n in weights if n.endswith("in_proj_qkvz.weight")]:
        prefix = name.removesuffix("in_proj_qkvz.weight")
        qkvz, ba = out.pop(name), out.pop(prefix + "in_proj_ba.weight")
        q, k, v, z = [p.reshape(-1, qkvz.shape[1]) for p in qkvz.reshape(nk, -1, qkvz.shape[1]).split(
            [dk, dk, group * config.linear_value_head_dim, group * config.linear_value_head_dim], dim=1)]
        b, a = [p.reshape(-1, ba.shape[1]) for p in ba.reshape(nk, 2 * group, ba.shape[1]).split(group, dim=1)]
        out.update({prefix + "in_proj_qkv.weight": torch.cat([q, k, v]), prefix + "in_proj_z.weight": z,
                    prefix + "in_proj_b.weight": b, prefix + "in_proj_a.weight": a})
    return out


def _logits(config: ModelConfig, weights: dict, dtype=torch.float32) -> torch.Tensor:
    model = build_model(config, weights, dtype, torch.device("cpu"), batch_invariant=False)
    runner = ModelRunner(model, config, num_blocks=16, block_size=4, dtype=dtype, device=torch.device("cpu"),
                         ops=model.ops)
    chunk = ScheduledChunk("r", PROMPT, 0, [3, 1, 7, 5], True, SamplingParams(temperature=0), state_slot=0)
    inputs = runner.prepare_inputs(SchedulerOutput(chunks=[chunk]))
    return runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, torch.arange(len(PROMPT)))


def _stored_plus_one(family: str, name: str) -> bool:
    """The Qwen hybrids' (1 + w) norms, which llama.cpp stores with the 1 added (all but the DeltaNet's gated norm)."""
    return family.startswith("qwen3") and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


@pytest.mark.parametrize(("family", "qtype", "options"), [
    ("lfm2", Q.F32, {}),
    ("qwen3_5", Q.F32, {"mtp_layers": 1}),  # the draft head llama.cpp appends is skipped
    ("lfm2", Q.F16, {"fuse_qkv": True}),
    ("qwen3_5", Q.F16, {"fuse_qkv": True}),
    ("lfm2_moe", Q.F32, {}),
    ("qwen3_5_moe", Q.F32, {"mtp_layers": 1}),  # its MTP block's stacked experts are skipped too
    ("qwen3_next", Q.F32, {"mtp_layers": 1}),
    ("lfm2_moe", Q.F16, {"fuse_qkv": True}),
    ("qwen3_next", Q.F16, {"fuse_qkv": True}),
    ("qwen3_next", Q.F32, {"legacy_ssm_in": True}),  # older files: HF's in_proj_qkvz whole, as ssm_in
])
def test_gguf_loads_what_the_hf_directory_does(tmp_path, family: str, qtype: Q, options: dict) -> None:
    hf = tiny_hf_hybrid(family)
    _round_to(hf, qtype)
    write_hybrid_gguf(tmp_path / "tiny.gguf", hf, qtype, **options)
    ck = load_checkpoint(str(tmp_path / "tiny.gguf"))
    config, weights = _hf_dir(hf, tmp_path)

    # the same config, but for what only the tokenizer knows and the Qwen norm offset (stored in the file)
    offset = 0.0 if family.startswith("qwen3") else config.norm_weight_offset
    assert ck.config == dataclasses.replace(config, norm_weight_offset=offset, eos_token_ids=ck.config.eos_token_ids,
                                            bos_token_id=ck.config.bos_token_id)
    assert set(ck.weights) == set(_split_like_gguf(config, weights))
    for name, want in _split_like_gguf(config, weights).items():
        got = ck.weights[name]
        assert tuple(got.shape) == tuple(want.shape), name
        if name.endswith("A_log"):  # stored as -exp(A_log): back within an ulp
            torch.testing.assert_close(got, want, rtol=2e-7, atol=1e-7)
        else:
            assert torch.equal(got.float(), want + 1 if _stored_plus_one(family, name) else want), name

    torch.testing.assert_close(_logits(ck.config, ck.weights), _logits(config, weights), atol=1e-5, rtol=1e-5)


# Routers (and the shared expert's gate) the converter keeps in F32.
_ROUTERS = ("mlp.gate.weight", "feed_forward.gate.weight", "shared_expert_gate.weight")


@pytest.mark.parametrize(("family", "value_head_dim"), [
    ("lfm2", None), ("qwen3_5", 32), ("qwen3_5", 8), ("lfm2_moe", None), ("qwen3_5_moe", 32), ("qwen3_5_moe", 8),
    ("qwen3_next", None),  # 8-wide value heads, but no reorder to undo
])
def test_q8_0_matrices_stay_blocks(tmp_path, caplog, family: str, value_head_dim: int | None) -> None:
    """Q8_0 linears, each expert's included, load as GGML blocks; value-head reorders undone on whole block rows
    (and, for out_proj's columns, whole blocks when a head spans whole blocks: else it is dequantized, with a
    warning); Qwen3-Next's b|a rows per key head split on whole block rows."""
    hf = tiny_hf_hybrid(family, **({"linear_value_head_dim": value_head_dim} if value_head_dim else {}))
    _round_to(hf, Q.Q8_0)
    write_hybrid_gguf(tmp_path / "tiny.gguf", hf, Q.Q8_0)
    with caplog.at_level(logging.WARNING, logger="conveyor.models.qwen3_5"):
        ck = load_checkpoint(str(tmp_path / "tiny.gguf"))
    config, weights = _hf_dir(hf, tmp_path)

    dense_out_proj = value_head_dim == 8  # 8-wide heads in 32-wide Q8_0 blocks
    for name, want in _split_like_gguf(config, weights).items():
        got = ck.weights[name]
        if (want.dim() == 2 and not name.endswith(_ROUTERS)
                and not (dense_out_proj and name.endswith("linear_attn.out_proj.weight"))):
            assert isinstance(got, QuantizedTensor) and got.qtype == Q.Q8_0, name
            got = got.dequantize()
        assert torch.equal(got.float(), want + 1 if _stored_plus_one(family, name) else want) or name.endswith(
            "A_log"), name
    assert ("dequantized at load" in caplog.text) == dense_out_proj

    want = _logits(config, weights)
    torch.testing.assert_close(_logits(ck.config, ck.weights), want, atol=1e-5, rtol=1e-5)
    # bf16 runs the blocks as they are in the file
    model = build_model(ck.config, ck.weights, torch.bfloat16, torch.device("cpu"), batch_invariant=False)
    assert "Q8_0" in weight_bytes_by_format(model)
    if config.num_experts:  # each expert one packed Q8_0 linear
        moe = next(layer.mixers[-1] for i, layer in enumerate(model.layers) if config.is_moe_layer(i))
        assert all(expert.down_proj.segments for expert in moe.experts)
    torch.testing.assert_close(_logits(ck.config, ck.weights, torch.bfloat16), want, atol=2e-2, rtol=0)


@pytest.mark.parametrize(("family", "pre", "pieces"), [
    ("lfm2", "lfm2", ["Hello", ",", " world", "123", "45"]),  # llama3's split: digits in threes
    ("qwen3_5", "qwen35", ["Hello", ",", " world", "1", "2", "3", "4", "5"]),
])
def test_tokenizer_and_chat_template_metadata(tmp_path, family: str, pre: str, pieces: list[str]) -> None:
    write_hybrid_gguf(tmp_path / "tiny.gguf", tiny_hf_hybrid(family), pre=pre, chat_template=CHATML)
    tokenizer = load_checkpoint(str(tmp_path / "tiny.gguf")).tokenizer
    split = tokenizer.backend.pre_tokenizer.pre_tokenize_str("Hello, world12345")
    assert [piece.replace("\u0120", " ") for piece, _ in split] == pieces
    ids = tokenizer.encode("hi")
    assert ids[0] == 1 if family == "lfm2" else ids[0] != 1  # llama.cpp adds BOS for the lfm2 vocabulary
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("arch", ["granitehybrid", "nemotron_h", "falcon-h1", "mamba2"])
def test_hybrids_not_supported_yet_are_named(tmp_path, arch: str) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    writer.add_block_count(2)
    writer.add_head_count_kv([0, 2])  # per layer, as the Mamba hybrids write it
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LoadError, match=f"GGUF architecture '{arch}' .* is not supported yet"):
        load_checkpoint(str(tmp_path / "m.gguf"))


@pytest.mark.parametrize(("family", "qtype"), [("qwen3_5", Q.F32), ("qwen3_next", Q.F32), ("qwen3_5_moe", Q.F32),
                                               ("qwen3_5", Q.Q8_0)])
def test_the_mtp_head_llama_cpp_appends_is_read_for_mtp_drafting(tmp_path, family: str, qtype: Q) -> None:
    """convert_hf_to_gguf appends the MTP head as block N (blk.N.nextn.eh_proj / enorm / hnorm / shared_head_norm
    and the block's own tensors): it loads to the HF directory's mtp.* tensors (norms stored as 1 + w; Q8_0
    matrices kept as blocks), and drafts."""
    hf = tiny_hf_hybrid(family)
    config, _ = _hf_dir(hf, tmp_path)
    head = random_mtp_weights(config)
    write_hybrid_gguf(tmp_path / "tiny.gguf", hf, qtype, mtp=head)
    ck = load_checkpoint(str(tmp_path / "tiny.gguf"))
    assert set(ck.mtp_weights) == set(head)
    for name, want in head.items():
        got = ck.mtp_weights[name]
        if isinstance(got, QuantizedTensor):
            assert qtype == Q.Q8_0 and tuple(got.shape) == tuple(want.shape), name
            got = got.dequantize()
            blocks = gguf.quants.quantize(want.numpy(), qtype)
            want = torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, qtype)))
        plus_one = _stored_plus_one(family, name) or name.startswith("mtp.pre_fc_norm_")  # enorm, hnorm in the file
        assert torch.equal(got.float(), want + 1 if plus_one else want), name
    assert qtype == Q.F32 or isinstance(ck.mtp_weights["mtp.fc.weight"], QuantizedTensor)

    prompts = ["<|im_start|>user\nhi there<|im_end|>", "a b c d e f g"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = LLM(checkpoint=ck, parallel=2, speculative_ngram=0).generate(prompts, params)
    spec = LLM(checkpoint=ck, parallel=2, draft_kind="mtp", draft_policy="enable", speculative_max_rows=64)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain]
    assert spec.engine.scheduler.stats.num_model_draft_tokens > 0
