"""Our bf16 GEMM (kernels/csrc/gemm.cpp): close to fp32 math, and every row's bits independent of M."""

import os
import subprocess
import sys

import pytest
import torch

from conveyor.models.layers import RowInvariantLinear
from tests.kernels.conftest import kernel_backend

backend = kernel_backend("gemm")

# Odd shapes on purpose: K not a multiple of 32 (nor even), N not a multiple of the 64-column panel.
IN_FEATURES, OUT_FEATURES = 75, 150


def make_linear(bias: bool) -> RowInvariantLinear:
    gen = torch.Generator().manual_seed(0)
    linear = RowInvariantLinear(IN_FEATURES, OUT_FEATURES, bias=bias, ops=backend)
    linear.weight.data = (torch.randn(OUT_FEATURES, IN_FEATURES, generator=gen) * 0.1).bfloat16()
    if bias:
        linear.bias.data = torch.randn(OUT_FEATURES, generator=gen).bfloat16()
    assert linear.prepack() and linear.row_invariant_kernel
    return linear


@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp32_reference(bias):
    linear = make_linear(bias)
    x = torch.randn(37, IN_FEATURES, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = torch.nn.functional.linear(x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float())
    got = linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == (37, OUT_FEATURES)
    # fp32 accumulation, one rounding to bf16 at the end: within a couple of bf16 ulps.
    assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2)


def row_invariance_holds() -> bool:
    linear = make_linear(bias=True)
    x = torch.randn(70, IN_FEATURES, generator=torch.Generator().manual_seed(2)).bfloat16()
    alone = torch.cat([linear(x[i:i + 1]) for i in range(len(x))])
    # Every batch size around the kernel's 16-row tiles, and rows in different positions.
    for m in (2, 3, 15, 16, 17, 31, 32, 33, 70):
        if not torch.equal(linear(x[:m]), alone[:m]) or not torch.equal(linear(x[-m:]), alone[-m:]):
            return False
    return linear(x[:0]).shape == (0, OUT_FEATURES)


def test_rows_do_not_depend_on_batch():
    assert row_invariance_holds()


@pytest.mark.skipif(backend.name != "amx", reason="the AMX -> AVX-512 BF16 switch exists only on AMX CPUs")
def test_avx512_fallback_is_row_invariant_too():
    """Without AMX the kernel runs on AVX-512 BF16 dot products; chosen once per process."""
    code = ("import torch, tests.kernels.test_gemm as t; "
            "assert t.backend.name == 'avx512_bf16'; "
            "assert t.row_invariance_holds(); t.test_matches_fp32_reference(True)")
    env = {**os.environ, "CONVEYOR_DISABLE_AMX": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
