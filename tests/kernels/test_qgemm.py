"""The quantized GEMM (kernels/csrc/qgemm.cpp) against gguf-py's dequantize + an fp32 matmul.

Runs at the level CONVEYOR_KERNEL_ARCH selects (avx512_vnni, avx2_vnni, avx2 or generic). Every
GGML type we run natively is checked for: accuracy against the reference (the activations are
quantized per 32-block to int8, so the error is that of the activation rounding, stated below),
exact dequantization of rows (the embedding path), and bitwise row invariance at every M.
"""

import os
import subprocess
import sys

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


def _cpu_vendor() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")


def test_decode_prefetch_follows_the_level_and_the_cpu_vendor():
    # Plain AVX2's decode walks stream with prefetchnta on AMD and prefetcht1 elsewhere (measured on each).
    level = backend.qgemm.backend()
    expected = {"avx2": "prefetchnta" if _cpu_vendor() == "AuthenticAMD" else "prefetcht1",
                "generic": "none"}.get(level, "prefetcht0")
    assert backend.qgemm.decode_prefetch() == expected


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
    # Stated tolerance: activations are int8 per 32-block (per 256 for Q4_K on the avx2, avx512_vnni and amx_int8
    # levels; relative error <= 1/254 of the block's max per element), output rounded once to bf16: within 2% of
    # the output's scale.
    scale = want.abs().max()
    assert (got.float() - want).abs().max() <= 0.02 * scale + 1e-3


def _activation_block(qtype: int) -> int:
    """Values per activation scale at this level (docs/kernels.md): 256 for Q4_K on plain AVX2, AVX-512 VNNI and
    AMX int8 (at every M there) and for Q6_K on AVX-512 VNNI, else 32."""
    level = backend.qgemm.backend()
    if qtype == Q.Q4_K and level in ("avx2", "avx512_vnni", "amx_int8"):
        return 256
    return 256 if qtype == Q.Q6_K and level == "avx512_vnni" else 32


def _quantized_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x as the kernel rounds it: int8 per `block` values (scale amax/127, half to even), in float64."""
    v = x.float().reshape(x.shape[0], -1, block)
    amax = v.abs().amax(-1, keepdim=True)
    # fp32 steps each rounded once, as the kernel's 127.f / amax and v * inv (torch's fp32 division and product
    # can land an ulp off, which moves a tie such as 63.5 to the other integer)
    inv = torch.where(amax > 0, 127.0 / amax.double(), torch.zeros_like(amax, dtype=torch.float64)).float()
    q = torch.round((v.double() * inv.double()).float()).clamp(-127, 127)
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


@pytest.mark.parametrize("qtype", TYPES, ids=type_name)
def test_activation_rounding_is_the_levels_stated_block(qtype):
    """The integer part is exact, so the output is the exact product of the rounded activations with the
    weights, up to fp32 steps and one bf16 rounding: this pins which block the level quantizes by (32-blocks
    whose scales differ 30x apart make per-32 and per-256 rounding far apart)."""
    in_features, out_features = 512, 40
    raw = random_raw(qtype, out_features, in_features, seed=5)
    packed = backend.pack_quantized(raw, qtype, in_features)
    gen = torch.Generator().manual_seed(6)
    spread = torch.tensor([30.0, 1.0, 0.5, 3.0, 0.1, 1.0, 8.0, 0.3]).repeat_interleave(32).repeat(2)
    x = (torch.randn(4, in_features, generator=gen) * spread).bfloat16()
    got = backend.quantized_linear(x, packed, qtype, out_features, in_features, None).double()
    weight = dequantize_raw(raw, qtype, in_features).double()
    block = _activation_block(qtype)
    want = _quantized_activations(x, block) @ weight.T
    other = _quantized_activations(x, 288 - block) @ weight.T  # the other scheme, 32 <-> 256
    tol = want.abs() * 2.0 ** -8 + 1e-4 * want.abs().max()  # bf16's half ulp, plus fp32 steps
    assert ((got - want).abs() <= tol).all()
    assert ((other - want).abs() > tol).any()  # the check can tell the two schemes apart


@pytest.mark.parametrize("in_features", [512, 2048])
def test_q4k_prefill_sizes_are_the_rounded_activations_times_the_weights(in_features):
    """From 16 rows on, amx_int8 runs Q4_K on its own tiles (sub-block scales folded into the weights, two
    16-row blocks per B load): at M = 16, 48 (a pair and a single block) and 100, every output is the exact
    product of the level's rounded activations with the dequantized weights, as at decode sizes."""
    out_features = 40
    raw = random_raw(Q.Q4_K, out_features, in_features, seed=21)
    packed = backend.pack_quantized(raw, Q.Q4_K, in_features)
    gen = torch.Generator().manual_seed(22)
    spread = torch.tensor([30.0, 1.0, 0.5, 3.0, 0.1, 1.0, 8.0, 0.3]).repeat_interleave(32).repeat(in_features // 256)
    x = (torch.randn(100, in_features, generator=gen) * spread).bfloat16()
    weight = dequantize_raw(raw, Q.Q4_K, in_features).double()
    want = _quantized_activations(x, _activation_block(Q.Q4_K)) @ weight.T
    for m in (16, 48, 100):
        got = backend.quantized_linear(x[:m], packed, Q.Q4_K, out_features, in_features, None).double()
        tol = want[:m].abs() * 2.0 ** -8 + 1e-4 * want[:m].abs().max()
        assert ((got - want[:m]).abs() <= tol).all(), m


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


# AMX (amx_int8) against the VNNI tiles it replaces from 16 rows on: per type, rows by M and by batch start.
AMX_ROWS = (1, 15, 16, 17, 64, 100, 256)
AMX_STARTS = (0, 3, 40)


def amx_cases() -> dict[str, torch.Tensor]:
    """Each type's outputs for rows [start, start + M) of one input (K = 512; K = 8192 for Q4_K, where an AMX
    work item spans fewer rows than M), with a bias; keyed by 'type K M start'."""
    out = {}
    gen = torch.Generator().manual_seed(11)
    # One and three chunks (the pipeline's ends), and K = 8192 for Q4_K.
    for qtype, in_features in [(q, 512) for q in TYPES] + [(Q.Q4_1, 32), (Q.Q8_0, 96), (Q.Q4_K, 8192)]:
        out_features = 40  # two whole 16-column groups and a partial one
        packed = backend.pack_quantized(random_raw(qtype, out_features, in_features, seed=12), qtype, in_features)
        bias = torch.randn(out_features, generator=gen).bfloat16()
        x = (torch.randn(AMX_STARTS[-1] + AMX_ROWS[-1], in_features, generator=gen) * 2).bfloat16()
        for m in AMX_ROWS:
            for start in AMX_STARTS:
                out[f"{type_name(qtype)} {in_features} {m} {start}"] = backend.quantized_linear(
                    x[start:start + m], packed, qtype, out_features, in_features, bias)
    return out


@pytest.mark.skipif(backend.qgemm.backend() != "amx_int8", reason="AMX int8 runs only in AMX builds on AMX CPUs")
def test_amx_rows_equal_the_vnni_paths_bit_for_bit(tmp_path):
    """The AMX tiles (from 16 rows on) and, with CONVEYOR_DISABLE_AMX (decided once per process), the AVX-512
    VNNI tiles give every row the same bits at every M and batch position, Q4_K included (both levels quantize its
    activations per 256 at every M and take one float step per superblock), but Q6_K (per superblock on avx512_vnni,
    per 16 on amx_int8); and each row its M = 1 bits."""
    path = tmp_path / "vnni.pt"
    code = ("import sys, torch, tests.kernels.test_qgemm as t; "
            "assert t.backend.qgemm.backend() == 'avx512_vnni'; torch.save(t.amx_cases(), sys.argv[1])")
    env = {**os.environ, "CONVEYOR_DISABLE_AMX": "1"}
    result = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    vnni, amx = torch.load(path), amx_cases()
    assert vnni.keys() == amx.keys()
    for key, got in amx.items():
        if key.startswith("Q6_K "):
            assert not torch.equal(got, vnni[key]), key  # the two levels' contracts differ: the check can tell
            continue
        assert torch.equal(got.view(torch.int16), vnni[key].view(torch.int16)), key  # bits: -0.0 is not 0.0
    # Row i of [start, start + M) has the bits of row start + i in the 256-row batch (M = 1: the row alone, on VNNI).
    for name in {key.split()[0] for key in amx}:
        for in_features in {key.split()[1] for key in amx if key.startswith(name + " ")}:
            base = amx[f"{name} {in_features} 256 0"]
            for m in AMX_ROWS:
                for start in AMX_STARTS:
                    got = amx[f"{name} {in_features} {m} {start}"].view(torch.int16)
                    overlap = max(0, min(m, 256 - start))
                    want = base[start:start + overlap].view(torch.int16)
                    assert torch.equal(got[:overlap], want), (name, in_features, m, start)


# Rows per expert: empty experts, single rows, a 17-row expert past the 8-row tile (T from 1 to 40).
EXPERT_ROWS = [[1], [0, 1], [3, 0, 1], [0, 17, 0], [17, 3, 0, 1, 17, 0, 2], [1, 1, 1, 1, 0, 3, 17, 3, 0, 13]]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.MXFP4], ids=type_name)
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_rows_equal_linear_on_each_experts_rows(qtype, bias):
    """One grouped call over all experts gives each row the bits `linear` gives it on its expert's rows alone."""
    in_features, out_features, num_experts = 256, 40, 10
    gen = torch.Generator().manual_seed(8)
    packed = [backend.pack_quantized(random_raw(qtype, out_features, in_features, seed=10 + e), qtype, in_features)
              for e in range(num_experts)]
    biases = [torch.randn(out_features, generator=gen) if bias and e % 3 else None for e in range(num_experts)]
    for rows in EXPERT_ROWS:
        offsets = [0]
        for count in rows:
            offsets.append(offsets[-1] + count)
        x = torch.randn(offsets[-1], in_features, generator=gen).bfloat16()
        got = backend.quantized_linear_grouped(x, packed[:len(rows)], qtype, out_features, in_features, offsets,
                                               biases[:len(rows)] if bias else [])
        assert got.shape == (offsets[-1], out_features)
        for e, (start, end) in enumerate(zip(offsets, offsets[1:])):
            want = backend.quantized_linear(x[start:end], packed[e], qtype, out_features, in_features,
                                            biases[e] if bias else None)
            assert torch.equal(got[start:end], want), (rows, e)


def test_grouped_bad_calls_are_clear_errors():
    packed = [backend.pack_quantized(random_raw(Q.Q4_0, 32, 64), Q.Q4_0, 64)] * 2
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="experts \\+ 1"):
        backend.quantized_linear_grouped(x, packed, Q.Q4_0, 32, 64, [0, 3], [])
    with pytest.raises(RuntimeError, match="from 0 to"):
        backend.quantized_linear_grouped(x, packed, Q.Q4_0, 32, 64, [0, 1, 2], [])
    with pytest.raises(RuntimeError, match="not decrease"):
        backend.quantized_linear_grouped(x, packed, Q.Q4_0, 32, 64, [0, 4, 3], [])
    with pytest.raises(RuntimeError, match="one bias per expert"):
        backend.quantized_linear_grouped(x, packed, Q.Q4_0, 32, 64, [0, 1, 3], [None])


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


# --- MXFP4 (GPT-OSS's experts): E2M1 codes looked up, E8M0 scales ------------------------------------------

def _mxfp4_blocks(scale_bytes: torch.Tensor, seed: int) -> torch.Tensor:
    """Raw MXFP4 rows (N, K/32 * 17) with the given E8M0 byte per block (N, K/32) and random nibbles."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (*scale_bytes.shape, 16), generator=gen, dtype=torch.uint8)
    return torch.cat([scale_bytes.to(torch.uint8).unsqueeze(-1), codes], dim=-1).reshape(scale_bytes.shape[0], -1)


def test_mxfp4_reference_is_the_ocp_e2m1_table():
    """The oracle itself: gguf-py decodes a block as the OCP MX spec says (E2M1 values times 2^(e - 127))."""
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    codes = torch.arange(32) % 16  # k 0..15 in the low nibbles, k 16..31 in the high ones
    block = torch.cat([torch.tensor([127 + 3]), codes[:16] | (codes[16:] << 4)]).to(torch.uint8)
    got = dequantize_raw(block.view(1, 17), Q.MXFP4, 32)
    assert torch.equal(got, torch.tensor(e2m1 * 2).view(1, 32) * 8.0)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # gguf-py's e = 255 blocks: inf, as ours
def test_mxfp4_every_scale_byte_dequantizes_as_gguf_py():
    # All 256 E8M0 bytes, subnormal powers of two (e < 2) and overflow to inf (e = 255 x 6) included.
    scales = torch.arange(256, dtype=torch.uint8).view(16, 16)
    raw = _mxfp4_blocks(scales, seed=5)
    packed = backend.pack_quantized(raw, Q.MXFP4, 512)
    got = backend.dequantize_rows(packed, Q.MXFP4, 16, 512, torch.arange(16))
    assert torch.equal(got, dequantize_raw(raw, Q.MXFP4, 512).bfloat16())


def test_mxfp4_extreme_scales_per_column():
    """Each column its own E8M0 byte (subnormal to large): the vector scale conversion on every path,
    checked column by column against float64 (so a tiny column is not hidden by a large one)."""
    column_e = torch.tensor([0, 1, 2, 3, 60, 126, 127, 128, 129, 150, 190, 2, 1, 0, 127, 100, 5, 131, 1, 64])
    in_features, out_features = 256, len(column_e)
    raw = _mxfp4_blocks(column_e.view(-1, 1).expand(-1, in_features // 32), seed=6)
    packed = backend.pack_quantized(raw, Q.MXFP4, in_features)
    x = torch.randn(64, in_features, generator=torch.Generator().manual_seed(7)).bfloat16()
    got = backend.quantized_linear(x, packed, Q.MXFP4, out_features, in_features, None)
    want = x.double() @ dequantize_raw(raw, Q.MXFP4, in_features).double().T
    column_scale = want.abs().amax(dim=0)
    assert ((got.double() - want).abs() <= 0.02 * column_scale).all()
    assert (got != 0).any(dim=0).all()  # no column flushed to zero
    for m in (1, 16):
        assert torch.equal(backend.quantized_linear(x[:m], packed, Q.MXFP4, out_features, in_features, None), got[:m])
