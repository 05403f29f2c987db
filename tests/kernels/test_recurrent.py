"""Recurrent mixers (kernels/csrc/recurrent.cpp): against the torch references, and exact under any
chunking, any batch-mates and through snapshots."""

import pytest
import torch

from conveyor.kernels.recurrent import (StateMetadata, reference_gated_delta_rule, reference_gated_rms_norm,
                                        reference_short_conv, reference_silu_gate, reference_ssm_scan)
from tests.kernels.conftest import kernel_backend
from tests.oracle import private_name

kernels = kernel_backend("recurrent").recurrent
DTYPES = [torch.bfloat16, torch.float32]
SLOTS = 6


def _conv_case(dtype, T, gen, silu=True, C=24):
    K = 4
    x = torch.randn(T, C, generator=gen).to(dtype)
    w = torch.randn(C, K, generator=gen)
    bias = torch.randn(C, generator=gen)
    state = torch.randn(SLOTS, C, K - 1, generator=gen).to(dtype).float()
    run = lambda x, st, meta: kernels.short_conv(x, w, bias, st, *meta.args(), silu)  # noqa: E731
    ref = lambda x, st, meta: reference_short_conv(x, w, bias, st, meta, silu)  # noqa: E731
    return (x,), state, run, ref


def _delta_case(dtype, T, gen, dk=8, dv=6):
    Hk, Hv = 2, 4
    q, k = (torch.randn(T, Hk, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(T, Hv, dv, generator=gen).to(dtype)
    a, b = (torch.randn(T, Hv, generator=gen).to(dtype) for _ in range(2))
    A_log, dt_bias = torch.randn(Hv, generator=gen), torch.randn(Hv, generator=gen)
    state = torch.randn(SLOTS, Hv, dk, dv, generator=gen)
    run = lambda q, k, v, a, b, st, meta: kernels.gated_delta_rule(q, k, v, a, b, A_log, dt_bias, st, *meta.args())  # noqa: E731
    ref = lambda q, k, v, a, b, st, meta: reference_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, st, meta)  # noqa: E731
    return (q, k, v, a, b), state, run, ref


def _ssm_case(dtype, T, gen):
    H, P, G, N = 4, 6, 2, 8
    x = torch.randn(T, H, P, generator=gen).to(dtype)
    dt = torch.randn(T, H, generator=gen).to(dtype)
    B, C = (torch.randn(T, G, N, generator=gen).to(dtype) for _ in range(2))
    A_log, dt_bias, D = (torch.randn(H, generator=gen) for _ in range(3))
    state = torch.randn(SLOTS, H, P, N, generator=gen)
    # dt limits that both bind for some of these rows (softplus of N(0, 2) spans ~0.05..4)
    run = lambda x, dt, B, C, st, meta: kernels.ssm_scan(x, dt, B, C, A_log, dt_bias, D, st, *meta.args(), 0.3, 2.0)  # noqa: E731
    ref = lambda x, dt, B, C, st, meta: reference_ssm_scan(x, dt, B, C, A_log, dt_bias, D, st, meta, 0.3, 2.0)  # noqa: E731
    return (x, dt, B, C), state, run, ref


CASES = {"short_conv": _conv_case, "gated_delta_rule": _delta_case, "ssm_scan": _ssm_case,
         # wider than one block of the kernels' loops, with a tail: 64-channel conv blocks, 16-lane rows
         "short_conv_wide": lambda dtype, T, gen: _conv_case(dtype, T, gen, C=150),
         "gated_delta_rule_wide": lambda dtype, T, gen: _delta_case(dtype, T, gen, dk=32, dv=40),
         # a head's state of 40 floats: snapshots by memcpy, where the others take non-temporal stores
         "gated_delta_rule_odd": lambda dtype, T, gen: _delta_case(dtype, T, gen, dk=8, dv=5)}


def _rows(inputs, start, end):
    return tuple(t[start:end] for t in inputs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case, dtype):
    """Three sequences (a fresh one, two resuming from their slots) against the torch walk."""
    gen = torch.Generator().manual_seed(0)
    inputs, state, run, ref = CASES[case](dtype, 11, gen)
    meta = StateMetadata.build([5, 1, 5], [3, 0, 5], [True, False, False])
    ours_state, ref_state = state.clone(), state.clone()
    ours = run(*inputs, ours_state, meta)
    want = ref(*inputs, ref_state, meta)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.float(), want.float(), **tol)
    torch.testing.assert_close(ours_state, ref_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_chunking_batch_mates_and_snapshots_are_exact(case, dtype):
    """One sequence run whole, in chunks of 1/3/rest beside other sequences, and token by token: every
    output row and the final state bitwise equal; snapshots equal the state after that many tokens."""
    gen = torch.Generator().manual_seed(1)
    T = 9
    inputs, state, run, _ = CASES[case](dtype, T, gen)
    others, _, _, _ = CASES[case](dtype, 7, torch.Generator().manual_seed(2))

    whole_state = state.clone()
    whole = run(*inputs, whole_state, StateMetadata.build([T], [1], [True], [[(1, 4), (4, 5)]]))

    stepped_state = state.clone()
    stepped = []
    for t in range(T):
        stepped.append(run(*_rows(inputs, t, t + 1), stepped_state, StateMetadata.build([1], [1], [t == 0])))
        if t == 0:
            assert torch.equal(stepped_state[1], whole_state[4]), "snapshot after 1 token"
        if t == 3:
            assert torch.equal(stepped_state[1], whole_state[5]), "snapshot after 4 tokens"
    assert torch.equal(torch.cat(stepped), whole)
    assert torch.equal(stepped_state[1], whole_state[1])

    chunked_state = state.clone()
    pieces, start = [], 0
    for size, mates in ((1, 3), (3, 4), (T - 4, 0)):
        batch = tuple(torch.cat([o[:mates], x[start:start + size]]) for o, x in zip(others, inputs))
        meta = StateMetadata.build([mates, size] if mates else [size], [2, 1] if mates else [1],
                                   [True, start == 0] if mates else [start == 0])
        pieces.append(run(*batch, chunked_state, meta)[mates:])
        start += size
    assert torch.equal(torch.cat(pieces), whole)
    assert torch.equal(chunked_state[1], whole_state[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_fp32", [False, True])
@pytest.mark.parametrize("norm_before_gate,group,n", [(True, 16, 16), (False, 8, 16), (False, 16, 16), (True, 20, 20),
                                                      (False, 10, 40)])
def test_gated_rms_norm_matches_reference_and_rows_are_independent(dtype, x_fp32, norm_before_gate, group, n):
    """x in the model dtype (Qwen3.5) or fp32 (a Mamba2 scan's output); gate, weight and output in the model dtype."""
    gen = torch.Generator().manual_seed(3)
    x, gate = (torch.randn(7, n, generator=gen).to(dtype) for _ in range(2))
    if x_fp32:
        x = torch.randn(7, n, generator=gen)
    weight = torch.randn(n, generator=gen).to(dtype)
    ours = kernels.gated_rms_norm(x, gate, weight, 1e-6, group, norm_before_gate)
    want = reference_gated_rms_norm(x, gate, weight, 1e-6, group, norm_before_gate)
    assert ours.dtype == dtype == want.dtype
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, want, **tol)
    for r in (0, 6):
        assert torch.equal(kernels.gated_rms_norm(x[r:r + 1], gate[r:r + 1], weight, 1e-6, group, norm_before_gate),
                           ours[r:r + 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_column_slices_of_a_projection_are_read_in_place(dtype):
    """Inputs that are column slices of one wide projection (rows apart), as Qwen3.5's DeltaNet passes them,
    give bitwise what their contiguous copies give, outputs and states."""
    gen = torch.Generator().manual_seed(7)
    T, Hk, Hv, dk, dv, C = 5, 2, 4, 8, 12, 40
    meta = StateMetadata.build([2, 3], [1, 4], [False, True])
    wide = torch.randn(T, C + 2 * Hk * dk + Hv * dv + 2 * Hv + 3, generator=gen).to(dtype)
    x, q, k, v, a, b, _ = wide.split([C, Hk * dk, Hk * dk, Hv * dv, Hv, Hv, 3], dim=-1)
    q, k, v = q.view(T, Hk, dk), k.view(T, Hk, dk), v.view(T, Hv, dv)
    assert not x.is_contiguous() and not q.is_contiguous() and not a.is_contiguous()
    w, state = torch.randn(C, 4, generator=gen), torch.randn(SLOTS, C, 3, generator=gen)
    conv = [kernels.short_conv(xx, w, None, st, *meta.args(), True) for xx, st in ((x, state.clone()),
                                                                                  (x.contiguous(), state.clone()))]
    assert torch.equal(conv[0], conv[1])
    A_log, dt_bias = torch.randn(Hv, generator=gen), torch.randn(Hv, generator=gen)
    states = [torch.randn(SLOTS, Hv, dk, dv, generator=torch.Generator().manual_seed(8)) for _ in range(2)]
    outs = [kernels.gated_delta_rule(*args, A_log, dt_bias, st, *meta.args())
            for args, st in (((q, k, v, a, b), states[0]), (tuple(t.contiguous() for t in (q, k, v, a, b)), states[1]))]
    assert torch.equal(outs[0], outs[1]) and torch.equal(states[0], states[1])
    gate = v  # (T, Hv, dv), rows apart
    weight = torch.randn(dv, generator=gen).to(dtype)
    normed = kernels.gated_rms_norm(outs[0], gate, weight, 1e-6, dv, True)
    assert normed.shape == (T, Hv, dv)
    flat = kernels.gated_rms_norm(outs[0].reshape(-1, dv), gate.reshape(-1, dv), weight, 1e-6, dv, True)
    assert torch.equal(normed.view(-1, dv), flat)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_fp32", [False, True])
def test_silu_gate_rounds_as_torch(dtype, x_fp32):
    gen = torch.Generator().manual_seed(5)
    x, gate = (torch.randn(5, 33, generator=gen).to(dtype) for _ in range(2))
    if x_fp32:
        x = torch.randn(5, 33, generator=gen)
    ours = kernels.silu_gate(x, gate)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, reference_silu_gate(x, gate), atol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                               rtol=0)
    assert torch.equal(kernels.silu_gate(x[2:3], gate[2:3]), ours[2:3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_mul_rounds_as_torch(dtype):
    gen = torch.Generator().manual_seed(4)
    x, gate = (torch.randn(5, 33, generator=gen).to(dtype) for _ in range(2))
    ours = kernels.sigmoid_mul(x, gate)
    torch.testing.assert_close(ours, x * torch.sigmoid(gate), atol=1e-2 if dtype == torch.bfloat16 else 1e-6, rtol=0)
    assert torch.equal(kernels.sigmoid_mul(x[2:3], gate[2:3]), ours[2:3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_rounds_as_torch_and_rows_are_independent(dtype):
    x = torch.randn(37, 9, generator=torch.Generator().manual_seed(5)).to(dtype) * 4
    ours = kernels.sigmoid(x)
    torch.testing.assert_close(ours, torch.sigmoid(x), atol=1e-2 if dtype == torch.bfloat16 else 1e-6, rtol=0)
    for start, rows in ((0, 1), (3, 7), (36, 1)):  # a row's bits whatever its place in the tensor
        assert torch.equal(kernels.sigmoid(x[start:start + rows]), ours[start:start + rows])
    assert torch.equal(kernels.sigmoid(x[:, :1]), ours[:, :1])  # a (T, 1) gate column, as MoE blocks pass it


def test_bad_inputs_are_refused():
    x = torch.randn(4, 8)
    state = torch.zeros(2, 8, 3)
    w = torch.randn(8, 4)
    with pytest.raises(RuntimeError, match="state slot out of range"):
        kernels.short_conv(x, w, None, state, *StateMetadata.build([4], [2], [True]).args(), False)
    with pytest.raises(RuntimeError, match="cover the rows"):
        kernels.short_conv(x, w, None, state, *StateMetadata.build([3], [0], [True]).args(), False)
    with pytest.raises(RuntimeError, match="snapshot count outside"):
        kernels.short_conv(x, w, None, state, *StateMetadata.build([4], [0], [True], [[(5, 1)]]).args(), False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ssm_scan_and_gated_norm_match_transformers_mamba2(dtype):
    """The scan and gated norm against transformers' own Mamba2 torch path (chunked scan from an initial
    state, several chunks; then its gated RMSNorm): dt's steps rounded in the model dtype, y kept in fp32."""
    mamba2_chunk_scan = private_name("transformers.models.mamba2.modeling_mamba2:mamba2_chunk_scan")
    gated_norm_class = private_name("transformers.models.mamba2.modeling_mamba2:Mamba2RMSNormGated",  # >= 5.25
                                    "transformers.models.mamba2.modeling_mamba2:MambaRMSNormGated")
    gen = torch.Generator().manual_seed(6)
    T, H, P, G, N = 11, 4, 6, 2, 8
    x = torch.randn(T, H, P, generator=gen).to(dtype)
    dt = torch.randn(T, H, generator=gen).to(dtype)
    B, C = (torch.randn(T, G, N, generator=gen).to(dtype) for _ in range(2))
    A_log, dt_bias, D = (torch.randn(H, generator=gen).to(dtype) for _ in range(3))
    initial = torch.randn(H, P, N, generator=gen)
    state = torch.zeros(SLOTS, H, P, N)
    state[2] = initial
    ours = kernels.ssm_scan(x, dt, B, C, A_log.float(), dt_bias.float(), D.float(), state,
                            *StateMetadata.build([T], [2], [False]).args(), 0.3, float("inf"))
    want, final = mamba2_chunk_scan(x[None], dt[None], -torch.exp(A_log.float()), B[None], C[None],
                                           chunk_size=4, D=D, dt_bias=dt_bias, initial_states=initial[None],
                                           dt_softplus=True, dt_limit=(0.3, float("inf")), return_final_states=True)
    assert ours.dtype == want.dtype == torch.float32
    torch.testing.assert_close(ours, want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state[2], final[0], atol=1e-4, rtol=1e-4)

    gate = torch.randn(T, H * P, generator=gen).to(dtype)
    norm = gated_norm_class(H * P, group_size=H * P // G, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(H * P, generator=gen))
        want = norm(ours.reshape(T, H * P), gate).to(dtype)  # transformers rounds at out_proj's input
    got = kernels.gated_rms_norm(ours.reshape(T, H * P), gate, norm.weight.detach(), 1e-5, H * P // G, False)
    torch.testing.assert_close(got, want, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_delta_rule_column_blocks_are_the_plain_loops_bits(dtype):
    """dv a multiple of the register block (128) takes the blocked sweep; a column of S evolves from its own column
    and v's alone, so the first 120 columns (120: the plain loops) must come out bitwise the same: outputs, final
    state and snapshots, over a multi-token walk with a snapshot mid-way."""
    gen = torch.Generator().manual_seed(3)
    T, Hk, Hv, dk = 5, 1, 2, 16
    q, k = (torch.randn(T, Hk, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(T, Hv, 128, generator=gen).to(dtype)
    a, b = (torch.randn(T, Hv, generator=gen).to(dtype) for _ in range(2))
    A_log, dt_bias = torch.randn(Hv, generator=gen), torch.randn(Hv, generator=gen)
    state = torch.randn(SLOTS, Hv, dk, 128, generator=gen)
    meta = StateMetadata.build([T], [1], [False], [[(2, 3)]])
    wide = state.clone()
    out_wide = kernels.gated_delta_rule(q, k, v, a, b, A_log, dt_bias, wide, *meta.args())
    narrow = state[..., :120].contiguous()
    out_narrow = kernels.gated_delta_rule(q, k, v[..., :120].contiguous(), a, b, A_log, dt_bias, narrow, *meta.args())
    assert torch.equal(out_wide[..., :120], out_narrow)
    assert torch.equal(wide[1, ..., :120], narrow[1]), "final state"
    assert torch.equal(wide[3, ..., :120], narrow[3]), "snapshot after 2 tokens"
