"""Dense (unmasked) attention for vision towers (csrc/dense_attention.h), on whichever path this build runs: AMX
tiles on an AMX build, fp32 otherwise (every level runs these tests: scripts/kernel-levels.sh)."""

import os

import pytest
import torch

from conveyor.kernels.attention import reference_dense_attention
from tests.kernels.conftest import kernel_backend

backend = kernel_backend("attention")
kernel = backend.attention

# (patches, heads, head dim): SigLIP's 72 (Gemma 3), 64 and 80 (SmolVLM, Qwen-VL), tails of every width the AMX
# path cuts (8, 16, 40, 98: past its 96, so the fp32 path there too), patch counts off every block size.
SHAPES = [(1, 1, 8), (17, 2, 16), (37, 2, 72), (64, 3, 64), (100, 3, 40), (50, 2, 80), (33, 2, 96), (40, 2, 98),
          (129, 4, 72)]


def _qkv(P, H, D, seed=0, spare=0):
    """q, k, v (P, H * D) bf16 as column slices of one (P, 3 H D + spare) tensor whose other columns are NaN."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.full((P, 3 * H * D + spare), float("nan"), dtype=torch.bfloat16)
    fused[:, :3 * H * D] = (torch.randn(P, 3 * H * D, generator=gen) * 1.5).to(torch.bfloat16)
    return fused[:, :H * D], fused[:, H * D:2 * H * D], fused[:, 2 * H * D:3 * H * D]


def _exact(q, k, v, H):
    """float64 softmax(q k^T / sqrt(D)) v per head."""
    P, W = q.shape
    qh, kh, vh = (t.double().view(P, H, -1).transpose(0, 1) for t in (q, k, v))
    probs = torch.softmax(qh @ kh.transpose(1, 2) * (W // H) ** -0.5, dim=-1)
    return (probs @ vh).transpose(0, 1).reshape(P, W)


@pytest.mark.parametrize("P,H,D", SHAPES)
def test_matches_float64_within_bf16_rounding(P, H, D):
    q, k, v = _qkv(P, H, D)
    out = kernel.dense_attention(q, k, v, H, D ** -0.5)
    want = _exact(q, k, v, H)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and out.is_contiguous()
    err = (out.double() - want).abs()
    # The output's own rounding is half an ulp (2^-9 relative); P in bf16 (AMX path) adds about as much again.
    assert err.max() <= 4e-3 * want.abs().max() + 2e-3, (err.max(), want.abs().max())
    # ... and it is no worse than torch's bf16 path, on average.
    torch_err = (reference_dense_attention(q, k, v, H, D ** -0.5).double() - want).abs()
    assert err.mean() <= torch_err.mean() * 1.25 + 1e-4


@pytest.mark.parametrize("P,H,D", [(37, 2, 72), (129, 4, 72), (40, 2, 98)])
def test_same_bits_on_repeat_at_any_thread_count_and_layout(P, H, D):
    q, k, v = _qkv(P, H, D, seed=1, spare=5)
    first = kernel.dense_attention(q, k, v, H, D ** -0.5)
    assert torch.isfinite(first.float()).all()  # the NaN columns beside each slice are never read
    assert torch.equal(kernel.dense_attention(q, k, v, H, D ** -0.5), first)
    assert torch.equal(kernel.dense_attention(q.contiguous(), k.contiguous(), v.contiguous(), H, D ** -0.5), first)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel.dense_attention(q, k, v, H, D ** -0.5), first)
    finally:
        torch.set_num_threads(threads)


def test_a_query_block_never_reads_past_the_last_patch():
    """17 patches: the second block of 16 queries holds one; rows past P (NaN here) must not reach any output."""
    P, H, D = 17, 2, 72
    q, k, v = _qkv(P, H, D, seed=2)
    buffer = torch.full((3, 64, H * D), float("nan"), dtype=torch.bfloat16)
    for i, t in enumerate((q, k, v)):
        buffer[i, :P] = t
    out = kernel.dense_attention(buffer[0, :P], buffer[1, :P], buffer[2, :P], H, D ** -0.5)
    assert torch.equal(out, kernel.dense_attention(q.contiguous(), k.contiguous(), v.contiguous(), H, D ** -0.5))


def test_the_path_follows_the_build():
    amx = kernel.isa() == "amx" and os.environ.get("CONVEYOR_DISABLE_AMX") is None
    assert kernel.dense_attention_path(72) == ("amx" if amx else "fp32")
    assert kernel.dense_attention_path(98) == "fp32" and kernel.dense_attention_path(71) == "fp32"


def test_bad_inputs_are_refused():
    q, k, v = _qkv(8, 2, 16)
    with pytest.raises(RuntimeError, match="multiple of num_heads"):
        kernel.dense_attention(q, k, v, 3, 0.25)
    with pytest.raises(RuntimeError, match="shapes differ"):
        kernel.dense_attention(q, k[:4], v, 2, 0.25)
    with pytest.raises(RuntimeError, match="bf16"):
        kernel.dense_attention(q.float(), k.float(), v.float(), 2, 0.25)


def test_backend_routes_fp32_to_torch_and_bf16_by_path():
    q, k, v = _qkv(37, 2, 72, seed=3)
    qf, kf, vf = q.float(), k.float(), v.float()
    assert torch.equal(backend.dense_attention(qf, kf, vf, 2, 72 ** -0.5),
                       reference_dense_attention(qf, kf, vf, 2, 72 ** -0.5))
    got = backend.dense_attention(q, k, v, 2, 72 ** -0.5)
    if kernel.dense_attention_path(72) == "amx":
        assert torch.equal(got, kernel.dense_attention(q, k, v, 2, 72 ** -0.5))
    else:
        assert torch.equal(got, reference_dense_attention(q, k, v, 2, 72 ** -0.5))
