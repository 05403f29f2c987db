"""The quantized GEMM (kernels/csrc/qgemm.cpp) against gguf-py's dequantize + an fp32 matmul.

Runs at the level CONVEYOR_KERNEL_ARCH selects (avx512_vnni, avx2_vnni, avx2 or generic). Every
GGML type we run natively is checked for: accuracy against the reference (the activations are
quantized per 32-block to int8, so the error is that of the activation rounding, stated below),
exact dequantization of rows (the embedding path), and bitwise row invariance at every M.
"""

import gguf
import pytest
import torch

from conveyor.kernels.quant_ref import NATIVE_TYPES, dequantize_raw, reference_linear, type_name
from conveyor.testing import random_raw
from tests.kernels.conftest import kernel_backend

backend = kernel_backend("qgemm")
Q = gguf.GGMLQuantizationType
TYPES = sorted(NATIVE_TYPES)
# (in_features, out_features): K-quants need K % 256 == 0; N not a multiple of the 16-column group.
SHAPES = [(256, 40), (512, 16), (768, 7)]


@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_every_native_type_is_supported(qtype):
    assert backend.qgemm.supports(qtype)
    assert backend.runs_quantized(qtype)
    assert not backend.qgemm.supports(int(Q.IQ4_NL))
    assert backend.qgemm.backend() in ("amx_int8", "avx512_vnni", "avx2_vnni", "avx2", "generic")


@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
@pytest.mark.parametrize("in_features,out_features", SHAPES)
def test_dequantized_rows_equal_gguf_py(qtype, in_features, out_features):
    if in_features % gguf.GGML_QUANT_SIZES[Q(qtype)][0]:
        pytest.skip("shape not valid for this type")  # pragma: no cover - SHAPES are all multiples of 256
    raw = random_raw(qtype, out_features, in_features)
    packed = backend.pack_quantized(raw, qtype, in_features)
    ids = torch.arange(out_features - 1, -1, -1)
    got = backend.dequantize_rows(packed, qtype, out_features, in_features, ids)
    want = dequantize_raw(raw, qtype, in_features)[ids].bfloat16()
    assert torch.equal(got, want)


@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
@pytest.mark.parametrize("in_features,out_features", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_dequantize_then_fp32_matmul(qtype, in_features, out_features, bias):
    raw = random_raw(qtype, out_features, in_features, seed=1)
    packed = backend.pack_quantized(raw, qtype, in_features)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(11, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen) if bias else None
    got = backend.quantized_linear(x, packed, qtype, out_features, in_features, b)
    want = reference_linear(x, raw, qtype, b)
    assert got.dtype == torch.bfloat16 and got.shape == (11, out_features)
    # Stated tolerance: activations are int8 per 32-block (relative error <= 1/254 of the block's max
    # per element), output rounded once to bf16: within 2% of the output's scale.
    scale = want.abs().max()
    assert (got.float() - want).abs().max() <= 0.02 * scale + 1e-3


@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_rows_are_bitwise_independent_of_m_and_position(qtype):
    in_features, out_features = 512, 48
    raw = random_raw(qtype, out_features, in_features, seed=3)
    packed = backend.pack_quantized(raw, qtype, in_features)
    x = torch.randn(70, in_features, generator=torch.Generator().manual_seed(4)).bfloat16()
    single = torch.cat([backend.quantized_linear(x[i:i + 1], packed, qtype, out_features, in_features, None)
                        for i in range(70)])
    for m in (2, 3, 5, 8, 9, 16, 17, 33, 70):
        got = backend.quantized_linear(x[:m], packed, qtype, out_features, in_features, None)
        assert torch.equal(got, single[:m]), m
    # A row in the middle of a batch equals the row alone.
    assert torch.equal(backend.quantized_linear(x[20:45], packed, qtype, out_features, in_features, None),
                       single[20:45])


def test_bad_calls_are_clear_errors():
    raw = random_raw(Q.Q4_0, 32, 64)
    packed = backend.pack_quantized(raw, Q.Q4_0, 64)
    with pytest.raises(RuntimeError, match="features"):
        backend.quantized_linear(torch.zeros(2, 96, dtype=torch.bfloat16), packed, Q.Q4_0, 32, 64, None)
    with pytest.raises(RuntimeError, match="out_features mismatch"):
        backend.quantized_linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed, Q.Q4_0, 64, 64, None)
    with pytest.raises(RuntimeError, match="row bytes"):
        backend.pack_quantized(raw, Q.Q4_0, 96)
    with pytest.raises(RuntimeError, match="not supported"):
        backend.pack_quantized(raw, Q.IQ4_NL, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        backend.dequantize_rows(packed, Q.Q4_0, 32, 64, torch.tensor([32]))
