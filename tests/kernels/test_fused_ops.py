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


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_add_then_norm(dtype):
    gen = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(9, 200, generator=gen).to(dtype) for _ in range(2))  # 200: a masked tail lane group
    weight = torch.randn(200, generator=gen).to(dtype)
    summed, normed = kernels.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(summed, x + delta)  # one rounding, exactly torch's add
    ref = RMSNorm(200, 1e-5, resolve_backend("cpu", settings=KernelSettings(disable=True)))
    ref.weight.data = weight
    want = (ref.weight * (summed.float() * torch.rsqrt(summed.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype))
    assert torch.allclose(normed.float(), want.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    assert torch.equal(kernels.rms_norm(summed, weight, 1e-5), normed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    gate_up = (torch.randn(5, 2 * 120, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = kernels.silu_mul(gate_up)
    if dtype == torch.bfloat16:  # our exp is not Sleef's: at most a bf16 step apart after rounding
        assert bf16_ulps(got, want) <= 1 and (got == want).float().mean() > 0.99
    else:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 24])  # 24: half not a multiple of 16 takes the scalar loop
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
