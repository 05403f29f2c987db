"""benchmarks/gpt_oss_gguf.py (the GPT-OSS-20B-shaped MXFP4 benchmark file, issue #25) writes what llama.cpp's
converter writes: the same tensor names, shapes and keys as test_gguf_gpt_oss's converter-mirroring writer, experts
in MXFP4 with sane scales, the rest as `--outtype q8_0` leaves it; and the file loads and generates here."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from test_gguf_gpt_oss import _hf_model, _write_gguf

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.loading import load_checkpoint
from conveyor.loading.checkpoint import QuantizedTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpt_oss_gguf import GptOssShape, make_tensor, tensor_plan, write  # noqa: E402

Q = gguf.GGMLQuantizationType


def _types(reader: gguf.GGUFReader) -> dict[str, tuple[tuple[int, ...], Q]]:
    return {t.name: (tuple(int(n) for n in reversed(t.shape)), Q(t.tensor_type)) for t in reader.tensors}


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gpt_oss_bench") / "tiny.gguf"
    write(path, GptOssShape.scaled(num_layers=2, scale=0.1))
    return path


def test_tensors_and_keys_are_the_converters(tmp_path) -> None:
    """Same names and shapes as the converter-mirroring test writer (its Q8_0 file) at the same sizes; experts
    MXFP4 where that file has Q8_0, every other type the same (router, biases, norms, sinks F32)."""
    model = _hf_model()
    cfg = model.config
    _write_gguf(tmp_path / "ref.gguf", model, Q.Q8_0)
    shape = GptOssShape(num_layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                        num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, num_experts=cfg.num_local_experts,
                        num_experts_used=cfg.num_experts_per_tok, expert_ffn=cfg.intermediate_size,
                        vocab=cfg.vocab_size, sliding_window=cfg.sliding_window)
    want = _types(gguf.GGUFReader(tmp_path / "ref.gguf"))
    got = {spec.name: (spec.shape, spec.qtype) for spec in tensor_plan(shape)}
    assert {n: s for n, (s, _) in got.items()} == {n: s for n, (s, _) in want.items()}
    for name, (_, qtype) in got.items():
        assert qtype == (Q.MXFP4 if name.endswith("_exps.weight") else want[name][1]), name


def test_written_file_metadata_and_blocks(tiny_file, tmp_path) -> None:
    reader = gguf.GGUFReader(tiny_file)
    ref_path = tmp_path / "ref.gguf"
    _write_gguf(ref_path, _hf_model(), Q.Q8_0)
    arch_keys = {k for k in gguf.GGUFReader(ref_path).fields if k.startswith("gpt-oss.")}
    assert arch_keys <= set(reader.fields)  # plus value_length, as the converter writes from head_dim
    assert reader.fields["gpt-oss.attention.sliding_window"].parts[-1][0] == 128
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == 201088
    texts = [bytes(tokens.parts[i]) for i in tokens.data]
    assert len(set(texts)) == len(texts)
    for t in reader.tensors:
        if Q(t.tensor_type) == Q.MXFP4:
            scales = np.asarray(t.data).reshape(-1, 17)[:, 0]
            assert scales.min() >= 118 and scales.max() <= 122, t.name
    experts = next(t for t in reader.tensors if t.name == "blk.1.ffn_up_exps.weight")
    values = gguf.quants.dequantize(np.asarray(experts.data), Q.MXFP4)
    assert np.abs(values).max() <= 12 * 2.0 ** -6 and 0.01 < values.std() < 0.05
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    values = gguf.quants.dequantize(np.asarray(embd.data), Q.Q8_0)
    assert np.isfinite(values).all() and 0.005 < values.std() < 0.03 and values.min() >= -127 * 3.5e-4 * 1.001


def test_blocks_are_random_per_seed() -> None:
    spec = next(s for s in tensor_plan(GptOssShape.scaled(1, 0.1)) if s.qtype == Q.MXFP4)
    a, b = (make_tensor(spec, np.random.default_rng(seed)) for seed in (0, 1))
    assert a.shape == b.shape and a.nbytes == spec.nbytes and not np.array_equal(a, b)


def test_conveyor_loads_and_generates(tiny_file) -> None:
    checkpoint = load_checkpoint(str(tiny_file))
    cfg = checkpoint.config
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.sliding_window) == ("gpt_oss", 32, 4, 128)
    assert tuple(cfg.layer_types) == ("sliding_attention", "full_attention")
    expert = checkpoint.weights["model.layers.0.mlp.experts.31.down_proj.weight"]
    assert isinstance(expert, QuantizedTensor) and expert.qtype == Q.MXFP4 and expert.shape == (288, 288)
    assert checkpoint.tokenizer.decode([60000]) == " pad60000"
    llm = LLM(checkpoint=checkpoint, parallel=2, kv_cache_budget="none")
    out = llm.generate(["The capital of France is", "Hello"], SamplingParams(temperature=0, max_tokens=6,
                                                                            ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in out) and out[0].token_ids != out[1].token_ids
