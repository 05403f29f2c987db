import pytest

from conveyor.bench.roofline import (Roofline, gflops_per_token_from_params, measure_bf16_gemm_gflops,
                                     parse_param_count)


def test_param_counts():
    assert parse_param_count("135M") == 135e6
    assert parse_param_count("1.5B") == 1.5e9
    assert parse_param_count("7e9") == 7e9
    with pytest.raises(ValueError):
        parse_param_count("lots")
    assert gflops_per_token_from_params(135e6) == pytest.approx(0.27)


def test_roofline_bound():
    assert Roofline(100.0, 0.5).max_tok_s == 200.0
    assert Roofline(100.0, 0.5).fraction(50.0) == 0.25
    assert Roofline(100.0, None).fraction(50.0) is None


def test_measure_gemm_runs():
    pytest.importorskip("torch")
    assert measure_bf16_gemm_gflops(m=8, k=64, n=64, min_time_s=0.05, device="cpu") > 0
