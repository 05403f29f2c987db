"""Fused CPU ops (kernels/csrc/fused_ops.cpp) against the torch op chains they replace."""

import pytest
import torch

from conveyor.models.layers import RMSNorm, RotaryEmbedding
from conveyor.kernels import KernelSettings, resolve_backend
from tests.kernels.conftest import kernel_backend

kernels = kernel_backend("fused_ops").fused
DTYPES = [torch.bfloat16, torch.float32]


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> int:
    """Largest distance in bf16 steps (same-sign values here, so the bit patterns are ordered)."""
    return int((got.view(torch.int16).int() - want.view(torch.int16).int()).abs().max())


# 200: a masked 16-lane tail (AVX-512), whole 8-lane groups (AVX2); 77 and 5: tails for both,
# 5 shorter than one vector.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [200, 77, 5])
def test_add_rms_norm_matches_add_then_norm(dtype, n):
    gen = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(9, n, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(n, generator=gen).to(dtype)
    summed, normed = kernels.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(summed, x + delta)  # one rounding, exactly torch's add
    ref = RMSNorm(n, 1e-5, resolve_backend("cpu", settings=KernelSettings(disable=True)))
    ref.weight.data = weight
    want = (ref.weight * (summed.float() * torch.rsqrt(summed.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype))
    assert torch.allclose(normed.float(), want.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    assert torch.equal(kernels.rms_norm(summed, weight, 1e-5), normed)
    for r in (0, 4, 8):  # a row alone is bitwise the row in the batch
        alone_sum, alone = kernels.add_rms_norm(x[r:r + 1], delta[r:r + 1], weight, 1e-5)
        assert torch.equal(alone_sum, summed[r:r + 1]) and torch.equal(alone, normed[r:r + 1])


def test_add_rounds_specials_like_torch():
    """Ties, overflow to inf, inf - inf and NaN: the residual sum's bits are torch's. A NaN is
    c10::BFloat16's 0x7FC0 (torch's own vector loops write 0xFFFF, its scalar ones 0x7FC0)."""
    big = torch.finfo(torch.bfloat16).max
    tiny = torch.finfo(torch.bfloat16).tiny
    values = [1.0, 1.0 + 2 ** -7, big, -big, float("inf"), float("-inf"), float("nan"), 0.0, -0.0, tiny, 3.0]
    x = torch.tensor(values * 3, dtype=torch.bfloat16)[:29]  # 29: tails for 8 and 16 lanes
    delta = torch.tensor([2 ** -8, 2 ** -8, big, -big, float("-inf"), 1.0, 2.0, -0.0, -0.0, tiny, -3.0] * 3,
                         dtype=torch.bfloat16)[:29]
    summed, _ = kernels.add_rms_norm(x[None], delta[None], torch.ones(29, dtype=torch.bfloat16), 1e-5)
    want = x + delta
    nan = want.isnan()
    assert nan.any() and torch.equal(summed[0].isnan(), nan)
    assert torch.equal(summed[0][~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert (summed[0][nan].view(torch.int16) == 0x7FC0).all()


@pytest.mark.parametrize("dtype", DTYPES)
# 120: whole 8-lane groups, a 16-lane tail; 100 and 13: tails for both (13: one 8-lane vector and a tail).
@pytest.mark.parametrize("inter", [120, 100, 13])
def test_silu_mul_matches_torch(dtype, inter):
    gate_up = (torch.randn(5, 2 * inter, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = kernels.silu_mul(gate_up)
    if dtype == torch.bfloat16:  # our exp is not Sleef's: at most a bf16 step apart after rounding
        assert bf16_ulps(got, want) <= 1 and (got == want).float().mean() > 0.99
    else:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_matches_torch_and_rows_stand_alone(dtype):
    gate_up = (torch.randn(33, 2 * 100, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    got = kernels.gelu_tanh_mul(gate_up)
    if dtype == torch.bfloat16:  # our tanh is not Sleef's: a bf16 step apart at most (absolute, near 0)
        torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-3)
        # The vector levels' tanh ((1 - e) / (1 + e), e = exp(-2|y|)) is ~2 fp32 ulps where Sleef's is 1, and
        # 1 + tanh cancels for negative inputs in torch's formula as in ours, so more bf16 roundings differ
        # (~97 % equal on this input) than with the generic level's std::tanh (> 99 %).
        assert (got == want).float().mean() > (0.95 if kernels.isa() not in ("generic", "neon") else 0.99)
    else:  # a float step or two apart (std::tanh vs Sleef's)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(kernels.gelu_tanh_mul(gate_up[i:i + 1]), got[i:i + 1]) for i in (0, 17, 32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_in_place_is_gelu_tanh_mul_gate_and_position_free(dtype):
    """SigLIP's MLP activation: in place, close to torch's, bitwise gelu_tanh_mul's gate (times 1) in bf16, and every
    element the same bits in any lane, tail or batch."""
    x = (torch.randn(40, 100, generator=torch.Generator().manual_seed(11)) * 4).to(dtype)
    got = kernels.gelu_tanh_(x.clone())
    want = torch.nn.functional.gelu(x, approximate="tanh")
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-3)
        ones = torch.ones_like(x)
        assert torch.equal(kernels.gelu_tanh_mul(torch.cat([x, ones], dim=1)), got)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    flat = x.flatten()
    for shift in range(17):
        assert torch.equal(kernels.gelu_tanh_(flat[shift:shift + 77].clone()), got.flatten()[shift:shift + 77])
    wide = (torch.randn(24, 3072, generator=torch.Generator().manual_seed(12)) * 3).to(dtype)  # past every grain
    alone = torch.cat([kernels.gelu_tanh_(wide[i:i + 1].clone()) for i in range(len(wide))])
    assert torch.equal(kernels.gelu_tanh_(wide.clone()), alone)
    y = x.clone()
    assert kernels.gelu_tanh_(y).data_ptr() == y.data_ptr() and torch.equal(y, got)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.gelu_tanh_(x.t())


# 64 and 128: vector paths everywhere; 16 and 48: half a multiple of 8, not of 16 (vector on AVX2,
# scalar on AVX-512); 24: half not a multiple of 8 takes the scalar loop.
@pytest.mark.parametrize("head_dim", [64, 128, 16, 48, 24])
def test_rope_write_kv_is_torch_rotary_bit_for_bit(head_dim):
    gen = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads = 7, 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).bfloat16()
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None)
    positions = torch.tensor([0, 3, 5, 9, 17, 33, 63])
    cos, ssin = rotary.tables(positions, torch.bfloat16)
    key_cache = torch.zeros(4, 16, kv_heads, head_dim, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([0, 5, 17, 18, 40, 41, 63])
    q = kernels.rope_write_kv(qkv, cos.squeeze(1), ssin.squeeze(1), key_cache, value_cache, slots, heads)
    qk, v = qkv.split([(heads + kv_heads) * head_dim, kv_heads * head_dim], dim=-1)
    qk = RotaryEmbedding.apply(qk.view(tokens, heads + kv_heads, head_dim), cos, ssin)
    assert torch.equal(q, qk[:, :heads])
    assert torch.equal(key_cache.view(-1, kv_heads, head_dim)[slots], qk[:, heads:])
    assert torch.equal(value_cache.view(-1, kv_heads, head_dim)[slots], v.view(tokens, kv_heads, head_dim))


@pytest.mark.parametrize("n", [1, 7, 8, 9, 16, 17, 33, 49152])
def test_argmax_rows_first_max_wins(n):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, n, generator=gen)
    logits[1] = 0.5  # all equal: index 0
    logits[2, n // 2:] = float("inf")  # ties at +inf: the first one
    logits[3] = float("-inf")
    logits[4, -1] = 100.0  # the max in the tail
    got = kernels.argmax_rows(logits)
    assert torch.equal(got, logits.argmax(dim=-1))


def _gelu_exact(x: torch.Tensor) -> torch.Tensor:
    """x * Phi(x) in float64 (erfc: no cancellation in the negative tail)."""
    x64 = x.double()
    return x64 * 0.5 * torch.special.erfc(-x64 * 0.5 ** 0.5)


def test_gelu_erf_is_exact_gelu_in_float32():
    """Within a few fp32 ulps of x * Phi(x) everywhere Phi is normal, the negative tail included (where torch's
    1 + erf cancels), and within torch's own error of torch's gelu."""
    gen = torch.Generator().manual_seed(4)
    x = torch.cat([torch.linspace(-13.5, 13.5, 270_001), torch.randn(100_000, generator=gen) * 3,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1.0, -1.0, 1.4142135, -1.4142135, 2.828427, -2.828427])])
    got, want = kernels.gelu_erf(x), _gelu_exact(x)
    normal = want.abs() > torch.finfo(torch.float32).tiny * 1e3
    rel = ((got.double() - want).abs() / want.abs())[normal]
    assert rel.max() < 1e-6, float(rel.max())
    assert (got.double() - want).abs()[~normal].max() < 1e-36  # past -13: 0, a few 1e-37 from the exact value
    # torch's vector erf (Abramowitz-Stegun 7.1.26) is 1.5e-7 off: its gelu up to |x| * 7.5e-8
    torch.testing.assert_close(got, torch.nn.functional.gelu(x), rtol=1e-6, atol=2e-6)


def test_gelu_erf_specials():
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e30, -1e30, 0.0, -0.0, 20.0, -20.0])
    got = kernels.gelu_erf(x)
    assert got[0] == float("inf") and got[1].isnan() and got[2].isnan()  # -inf * Phi(-inf) = -inf * 0, as ndtr
    assert got[3] == 1e30 and got[4] == 0 and got[5] == 0 and got[6] == 0
    assert got[7] == 20.0 and got[8] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_erf_bits_do_not_depend_on_position_or_batch(dtype):
    """Every element is one formula: the same bits in any lane, in a vector's tail, alone, and in any batch."""
    x = (torch.randn(40, 100, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    got = kernels.gelu_erf(x)
    flat = x.flatten()
    for shift in range(17):  # every lane and tail position of 16- and 8-lane vectors
        assert torch.equal(kernels.gelu_erf(flat[shift:shift + 77]), got.flatten()[shift:shift + 77])
    assert all(torch.equal(kernels.gelu_erf(x[i:i + 1]), got[i:i + 1]) for i in (0, 17, 39))
    wide = (torch.randn(24, 3072, generator=torch.Generator().manual_seed(6)) * 3).to(dtype)  # past every grain
    alone = torch.cat([kernels.gelu_erf(wide[i:i + 1]) for i in range(len(wide))])
    assert all(torch.equal(kernels.gelu_erf(wide[:rows]), alone[:rows]) for rows in (5, 11, 17, 24))


def test_gelu_erf_bf16_is_the_exact_value_rounded_once():
    """bf16: the fp32 GELU rounded once, so the exact value's bf16 bar a rounding boundary; torch's bf16 gelu is ~86 %
    the same here, its 1 + erf cancelling in the negative tail (0 below -5.5)."""
    x = (torch.randn(64, 257, generator=torch.Generator().manual_seed(7)) * 4).bfloat16()
    got = kernels.gelu_erf(x)
    assert (got == _gelu_exact(x).bfloat16()).float().mean() > 0.999
    torch.testing.assert_close(got, torch.nn.functional.gelu(x), rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [120, 100, 13])
def test_gelu_erf_mul_matches_torch_and_rows_stand_alone(dtype, inter):
    gate_up = (torch.randn(33, 2 * inter, generator=torch.Generator().manual_seed(8)) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got = kernels.gelu_erf_mul(gate_up)
    assert torch.equal(got, kernels.gelu_erf(gate) * up)  # gelu rounds to the dtype, then the product does
    want = torch.nn.functional.gelu(gate) * up
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-3)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(kernels.gelu_erf_mul(gate_up[i:i + 1]), got[i:i + 1]) for i in (0, 17, 32))


def test_gelu_erf_fallback_is_the_same_function():
    """The torch fallback (no kernels) computes x * ndtr(x): close to the kernel's, and row-invariant too."""
    fallback = resolve_backend("cpu", torch.float32, settings=KernelSettings(disable=True))
    x = torch.randn(9, 300, generator=torch.Generator().manual_seed(9)) * 4
    # (torch's fp32 ndtr is (1 + erf) / 2: it cancels below x = -2 and is 0 below -5.5, so only absolutely close)
    torch.testing.assert_close(fallback.gelu_erf(x), kernels.gelu_erf(x), rtol=1e-5, atol=1e-6)
    assert all(torch.equal(fallback.gelu_erf(x[i:i + 1]), fallback.gelu_erf(x)[i:i + 1]) for i in (0, 4, 8))
    gate_up = torch.cat([x, x.flip(0)], dim=1)
    torch.testing.assert_close(fallback.gelu_erf_mul(gate_up), kernels.gelu_erf_mul(gate_up), rtol=1e-6, atol=1e-6)
