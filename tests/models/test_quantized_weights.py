"""GGML block-quantized weights: kept as blocks end to end (one copy), close to the dequantized path."""

from __future__ import annotations

import logging

import gguf
import pytest
import torch

from conveyor.config import kernel_settings_from_env
from conveyor.engine.llm import LLM
from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.kernels import cpu_backend
from conveyor.kernels.quant_ref import NATIVE_TYPES, type_name
from conveyor.loading import LoadError, load_checkpoint
from conveyor.models.layers import QuantizedEmbedding, RowInvariantLinear, TiedPackedEmbedding
from conveyor.models.registry import build_model
from conveyor.models.weights import count_params, weight_bytes_by_format
from conveyor.runner.model_runner import ModelRunner
from conveyor.testing import write_tiny_gguf

Q = gguf.GGMLQuantizationType
ops = cpu_backend(kernel_settings_from_env())
needs_qgemm = pytest.mark.skipif(not ops.runs_quantized(Q.Q8_0), reason=f"backend {ops.name} runs no GGML types")
PROMPT = [5, 17, 42, 8, 63, 21, 90, 3, 77, 12, 50]


def _build(checkpoint, weight_dtype: str = "auto"):
    return build_model(checkpoint.config, checkpoint.weights, torch.bfloat16, torch.device("cpu"), True, weight_dtype,
                       ops=ops, release=checkpoint.release_pages)


def _logits(model, config, tokens: list[int]) -> torch.Tensor:
    """Prefill logits of every position, through the paged cache as the engine runs it."""
    runner = ModelRunner(model, config, num_blocks=16, block_size=16, dtype=torch.bfloat16,
                         device=torch.device("cpu"), ops=ops)
    chunk = ScheduledChunk("r", tokens, 0, [3, 1], True, SamplingParams(temperature=0))
    inputs = runner.prepare_inputs(SchedulerOutput(chunks=[chunk]))
    return model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, torch.arange(len(tokens)))


def _assert_close_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    """The quantized kernel (int8 activations per 32-block, see docs/kernels.md) vs the dequantized weights
    rounded to bf16, through two random layers: measured mean |diff| 0.3-3.5% of mean |logit| and max
    |diff| up to 9% of max |logit| over the nine types and the mixed model (MXFP4: 3.4% and 4.8%; activation rounding,
    amplified by random weights; the SmolLM2 perplexity test bounds the effect on a real model)."""
    diff = (got - want).abs()
    assert torch.isfinite(got).all()
    assert diff.mean() <= 0.06 * want.abs().mean() and diff.max() <= 0.12 * want.abs().max(), diff.max()
    # Argmax over 11 rows of random logits flips on near-ties: Q8_0 agrees on 10/11 rows with the row attention path
    # and 8/11 with the AMX tile path (paged_amx.h), whose mean and max |diff| are the same (3.2 % / 3.7 %).
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.7


def _linears(model) -> list[RowInvariantLinear]:
    return [m for m in model.modules() if isinstance(m, RowInvariantLinear)]


@needs_qgemm
@pytest.mark.parametrize("qtype", sorted(NATIVE_TYPES), ids=type_name)
def test_native_type_stays_blocks_and_matches_dequantized(tmp_path, qtype: int) -> None:
    checkpoint = load_checkpoint(write_tiny_gguf(tmp_path / "tiny.gguf", qtype))
    model = _build(checkpoint)
    # One copy: every linear holds packed blocks of the file's type and no dense weight.
    for linear in _linears(model):
        assert linear.weight is None and linear.row_invariant_kernel
        assert [s.qtype for s in linear.segments] == [qtype], linear
    assert linear.segments[0].packed is model.embed_tokens.segment.packed  # the tied head is the embedding
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    formats = weight_bytes_by_format(model)
    assert set(formats) == {type_name(qtype), "BF16"}  # blocks, plus the norms in the model dtype
    dense = _build(checkpoint, "bf16")
    assert count_params(model, tied=True) == count_params(dense, tied=True)
    _assert_close_logits(_logits(model, checkpoint.config, PROMPT), _logits(dense, checkpoint.config, PROMPT))


@needs_qgemm
def test_mixed_types_run_as_segments_in_one_linear(tmp_path) -> None:
    """Q4_K_M's layout: v and down in Q6_K beside Q4_K; the fused qkv keeps a segment per run of one type."""
    types = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K, "ffn_gate": Q.Q4_K,
             "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K}
    checkpoint = load_checkpoint(write_tiny_gguf(tmp_path / "mixed.gguf", types, embed_type=Q.Q8_0, head_type=Q.Q6_K))
    model = _build(checkpoint)
    qkv = model.layers[0].self_attn.qkv_proj
    assert [(s.type_name, s.start, s.rows) for s in qkv.segments] == [("Q4_K", 0, 384), ("Q6_K", 384, 128)]
    x = torch.randn(5, qkv.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    whole = qkv(x)
    for sizes in ([384, 128], [256, 128, 128], [200, 184, 128], [300, 212]):  # the last straddles the two types
        parts = qkv.forward_split(x, sizes)
        assert [p.shape[1] for p in parts] == sizes
        assert all(torch.equal(p, w) for p, w in zip(parts, whole.split(sizes, dim=-1)))
    assert qkv.forward_split(x, [384, 128])[1].is_contiguous()  # the Q6_K segment's own output: nothing joined
    assert [s.type_name for s in model.layers[0].mlp.gate_up_proj.segments] == ["Q4_K"]  # one fused GEMM
    assert [s.type_name for s in model.lm_head.segments] == ["Q6_K"] and model.embed_tokens.segment.type_name == "Q8_0"
    dense = _build(checkpoint, "bf16")
    _assert_close_logits(_logits(model, checkpoint.config, PROMPT), _logits(dense, checkpoint.config, PROMPT))


def test_bf16_weight_dtype_and_torch_backend_dequantize(tmp_path) -> None:
    checkpoint = load_checkpoint(write_tiny_gguf(tmp_path / "tiny.gguf", Q.Q4_0))
    model = _build(checkpoint, "bf16")
    assert not any(linear.segments for linear in _linears(model))
    assert isinstance(model.embed_tokens, (torch.nn.Embedding, TiedPackedEmbedding))
    assert "Q4_0" not in weight_bytes_by_format(model)
    torch_ops = type(ops)(name="torch", device="cpu", arch=None, batch_invariant=False)  # no qgemm: blocks cannot run
    model = build_model(checkpoint.config, checkpoint.weights, torch.bfloat16, torch.device("cpu"), False, "auto",
                        ops=torch_ops)
    assert not any(linear.segments for linear in _linears(model)) and "Q4_0" not in weight_bytes_by_format(model)


def test_packed_bf16_linears_keep_one_copy(tiny_checkpoint) -> None:
    model = build_model(tiny_checkpoint.config, tiny_checkpoint.weights, torch.bfloat16, torch.device("cpu"), ops=ops)
    for linear in _linears(model):
        if linear.row_invariant_kernel or linear._packed is not None:
            assert linear.weight is None, "the dense weight stayed beside its packed copy"
    head = model.lm_head
    embedding = tiny_checkpoint.weights["model.embed_tokens.weight"].bfloat16()
    assert torch.equal(head.dense_weight(), embedding)  # unpacked on demand, bit for bit
    if tiny_checkpoint.config.tie_word_embeddings and head.row_invariant_kernel:
        # The tied embedding gathers its rows from the head's packed weight: one copy, the same bits.
        assert isinstance(model.embed_tokens, TiedPackedEmbedding)
        ids = torch.tensor([0, 5, embedding.shape[0] - 1, 5])
        assert torch.equal(model.embed_tokens(ids), embedding[ids])
        assert model.embed_tokens.stored_weights() == [] and not list(model.embed_tokens.parameters())


def test_non_native_type_is_dequantized_with_a_warning(tmp_path, caplog) -> None:
    path = write_tiny_gguf(tmp_path / "q2k.gguf", {"ffn_down": Q.Q2_K, "attn_q": Q.Q8_0}, embed_type=Q.Q3_K)
    with caplog.at_level(logging.WARNING, logger="conveyor.loading.gguf_loader"):
        checkpoint = load_checkpoint(path)
    messages = [r.getMessage() for r in caplog.records]
    assert any("blk.0.ffn_down.weight and 1 more tensors are Q2_K" in m for m in messages), messages
    assert any("token_embd.weight are Q3_K" in m for m in messages), messages
    model = _build(checkpoint)
    assert model.layers[0].mlp.down_proj.weight is not None or model.layers[0].mlp.down_proj.row_invariant_kernel
    assert not model.layers[0].mlp.down_proj.segments  # dense (packed bf16), not blocks
    assert torch.isfinite(_logits(model, checkpoint.config, PROMPT)).all()


def test_type_nobody_can_dequantize_is_a_load_error(tmp_path) -> None:
    path = write_tiny_gguf(tmp_path / "q81.gguf", {"ffn_down": Q.Q8_1}, embed_type=Q.Q8_0)
    with pytest.raises(LoadError, match=r"blk\.0\.ffn_down\.weight is Q8_1"):
        load_checkpoint(path)


@needs_qgemm
@pytest.mark.batch_invariant
def test_q8_0_weight_dtype_quantizes_a_float_checkpoint(tiny_checkpoint) -> None:
    llm = LLM(checkpoint=tiny_checkpoint, parallel=4, weight_dtype="q8_0")
    model = llm.engine.runner.model
    assert all([s.type_name for s in linear.segments] == ["Q8_0"] for linear in _linears(model))
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    assert set(llm.engine.weight_formats) == {"Q8_0", "BF16"}  # blocks, plus the norms in bf16
    prompts = [f"q8 prompt {i} " + "y " * (4 * i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    batched = llm.generate(prompts, params)
    for prompt, got in zip(prompts, batched):
        assert llm.generate([prompt], params)[0].token_ids == got.token_ids
