"""Our bf16 GEMM (kernels/csrc/gemm.cpp): close to fp32 math, and every row's bits independent of M.

Runs at the level CONVEYOR_KERNEL_ARCH selects; one build has one arithmetic path:
amx / avx512_bf16 (bf16 pair dot products), avx512 / avx2 (bf16 widened to fp32, one FMA chain
per output element) or generic (portable C++, one multiply-then-add chain per element; the same
bits as avx512 / avx2, see emulate_chain).
"""

import os
import subprocess
import sys

import pytest
import torch

from conveyor.models.layers import RowInvariantLinear
from tests.kernels.conftest import kernel_backend

backend = kernel_backend("gemm")
LEVEL = backend.gemm.backend()
F32_PATHS = ("avx512", "avx2", "generic")  # 16-column panels of bf16 pairs, widened to fp32

# Odd shapes on purpose: K not a multiple of 32 (nor even), N not a multiple of any panel width.
IN_FEATURES, OUT_FEATURES = 75, 150
# (in, out): odd and tiny ones, and SmolLM2-135M's (hidden 576, intermediate 1536, qkv 960).
SHAPES = [(75, 150), (1, 1), (2, 17), (33, 16), (576, 960), (1536, 576)]


def make_linear(bias: bool, in_features: int = IN_FEATURES, out_features: int = OUT_FEATURES) -> RowInvariantLinear:
    gen = torch.Generator().manual_seed(0)
    linear = RowInvariantLinear(in_features, out_features, bias=bias, ops=backend)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.1).bfloat16()
    linear.load_dense(weight, torch.randn(out_features, generator=gen).bfloat16() if bias else None)
    assert linear.prepack() and linear.row_invariant_kernel
    assert linear.weight is None and torch.equal(linear.dense_weight(), weight)  # one copy, unpacked on demand
    linear.reference_weight = weight  # the tests' own copy
    return linear


def test_every_build_has_a_path_and_packs_for_it():
    assert LEVEL in ("amx", "avx512_bf16", "avx512", "avx2", "generic")
    packed = backend.gemm.pack(torch.zeros(OUT_FEATURES, IN_FEATURES, dtype=torch.bfloat16))
    if LEVEL in F32_PATHS:
        assert packed.shape == (-(-OUT_FEATURES // 16), -(-IN_FEATURES // 2), 16, 2)
    else:
        assert packed.shape == (-(-OUT_FEATURES // 64), -(-IN_FEATURES // 32) * 16, 64, 2)
    with pytest.raises(RuntimeError, match="mismatch"):  # a weight packed for another K
        backend.gemm.linear(torch.zeros(3, IN_FEATURES + 64, dtype=torch.bfloat16), packed, OUT_FEATURES, None)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features,out_features", SHAPES)
def test_matches_fp32_reference(bias, in_features, out_features):
    linear = make_linear(bias, in_features, out_features)
    x = torch.randn(37, in_features, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = torch.nn.functional.linear(x.float(), linear.reference_weight.float(),
                                      None if linear.bias is None else linear.bias.float())
    got = linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == (37, out_features)
    # fp32 accumulation, one rounding to bf16 at the end: within a couple of bf16 ulps.
    assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2)


def emulate_chain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The f32 paths' arithmetic, step by step in torch: acc = 0; for k in order (K padded to
    even with a zero pair), acc = acc + x[k] w[k]; + bias; bf16. A bf16 x bf16 product has at
    most 16 significant bits, exact in fp32, so the FMA of avx2 / avx512 and the multiply-then-add
    of generic (and of this emulation) round alike: the three paths give the same bits (unless a
    product under- or overflows fp32)."""
    xf, wf = x.float(), weight.float()
    if x.shape[1] % 2:
        xf, wf = torch.nn.functional.pad(xf, (0, 1)), torch.nn.functional.pad(wf, (0, 1))
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(xf.shape[1]):
        acc = acc + xf[:, k:k + 1] * wf[:, k]
    if bias is not None:
        acc = acc + bias.float()
    out = acc.bfloat16()
    # c10::BFloat16's NaN (torch's vectorized fp32 -> bf16 conversion writes 0xFFFF instead).
    out.view(torch.int16)[acc.isnan()] = 0x7FC0
    return out


@pytest.mark.skipif(LEVEL not in F32_PATHS, reason="the bf16 dot-product paths round pairs their own way")
@pytest.mark.parametrize("bias", [False, True])
def test_f32_paths_are_one_chain_per_element(bias):
    """Bitwise the documented chain, so every row-tile and panel-group variant is that chain.
    Rows with inf, overflow and NaN check the rounding: nearest even, NaN -> 0x7FC0."""
    linear = make_linear(bias)
    x = torch.randn(37, IN_FEATURES, generator=torch.Generator().manual_seed(3)).bfloat16()
    x[5, 7] = float("inf")
    x[6, :] = 3e38
    x[7, 11] = float("nan")
    want = emulate_chain(x, linear.reference_weight, linear.bias)
    got = linear(x)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert (got[7].view(torch.int16) == 0x7FC0).all()


def row_invariance_holds(in_features: int = IN_FEATURES, out_features: int = OUT_FEATURES,
                         sizes=tuple(range(1, 71))) -> bool:
    linear = make_linear(True, in_features, out_features)
    n = max(sizes)
    x = torch.randn(n, in_features, generator=torch.Generator().manual_seed(2)).bfloat16()
    alone = torch.cat([linear(x[i:i + 1]) for i in range(n)])
    # Every batch size, rows in different positions.
    for m in sizes:
        if not torch.equal(linear(x[:m]), alone[:m]) or not torch.equal(linear(x[-m:]), alone[-m:]):
            return False
    return linear(x[:0]).shape == (0, out_features)


def test_rows_do_not_depend_on_batch():
    assert row_invariance_holds()


@pytest.mark.parametrize("in_features", [576, 1536])
def test_rows_do_not_depend_on_batch_at_prefill_sizes(in_features):
    """Up to 600 rows: past the f32 paths' cache row blocks (~85 rows at K=576, ~32 at K=1536)
    and the AMX 16-row tiles, with rows landing in different blocks."""
    assert row_invariance_holds(in_features, 200, sizes=(1, 31, 32, 33, 85, 86, 127, 128, 129, 300, 511, 512, 600))


def test_strided_rows_give_the_same_bits():
    linear = make_linear(True)
    wide = torch.randn(20, IN_FEATURES + 9, generator=torch.Generator().manual_seed(4)).bfloat16()
    view = wide[:, 3:3 + IN_FEATURES]  # rows IN_FEATURES + 9 apart
    assert torch.equal(linear(view), linear(view.contiguous()))


@pytest.mark.skipif(backend.name != "amx", reason="the AMX -> AVX-512 BF16 switch exists only on AMX CPUs")
def test_avx512_fallback_is_row_invariant_too():
    """Without AMX the kernel runs on AVX-512 BF16 dot products; chosen once per process."""
    code = ("import torch, tests.kernels.test_gemm as t; "
            "assert t.backend.name == 'avx512_bf16'; "
            "assert t.row_invariance_holds(); t.test_matches_fp32_reference(True, 75, 150)")
    env = {**os.environ, "CONVEYOR_DISABLE_AMX": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
