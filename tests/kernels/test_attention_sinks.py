"""Attention sinks (GPT-OSS: one learnt logit per query head in each softmax's denominator, no value) in the
attention kernel: against the torch reference on every dtype path (fp32, fp16, bf16 generic and register-blocked
shapes, q8_0 K and/or V), with and without a window, and rows bitwise invariant to batch-mates and chunking."""

import pytest
import torch

from conveyor.kernels.attention import AttentionMetadata, reference_paged_attention
from tests.kernels.conftest import kernel_backend
from tests.kernels.test_attention import _random_batch, _rows_meta
from tests.kernels.test_attention_q8 import _as_kernel_rounds_q, _query, _sequences

backend = kernel_backend("attention", "fused_ops")
# generic loops (32-dim heads), the register-blocked bf16 shapes (64 / 128 dims, 1-4 query heads per KV head),
# and more query heads per KV head than the vector paths take
SHAPES = [(6, 2, 32), (9, 3, 64), (4, 2, 128), (8, 2, 64), (4, 4, 64), (12, 1, 64)]


def _sinks(heads: int, seed: int = 3) -> torch.Tensor:
    # around the scores' own size, so that a sink takes a real share of each row's softmax
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 1.5 + 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("window", [0, 7])
def test_sinks_match_reference(dtype, heads, kv_heads, head_dim, window):
    query, kc, vc, meta = _random_batch([5, 40, 17, 100], [5, 1, 17, 3], dtype, heads=heads, kv_heads=kv_heads,
                                        head_dim=head_dim)
    scale, sinks = head_dim ** -0.5, _sinks(heads)
    got = backend.paged_attention(query, kc, vc, meta, scale, window, sinks=sinks)
    want = reference_paged_attention(query, kc, vc, meta, scale, window, sinks=sinks)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    plain = backend.paged_attention(query, kc, vc, meta, scale, window)
    assert (got.float() - plain.float()).abs().max() > 5e-2  # the sinks were applied


def test_reference_sinks_are_transformers_softmax():
    """The reference's sink column is GPT-OSS's eager attention: softmax over [scores, sink], sink dropped."""
    query, kc, vc, meta = _random_batch([9], [9], torch.float32, heads=4, kv_heads=2, head_dim=32)
    sinks = _sinks(4)
    got = reference_paged_attention(query, kc, vc, meta, 0.2, sinks=sinks)
    k = kc[meta.block_tables[0, 0]][:9].repeat_interleave(2, dim=1).transpose(0, 1)  # (H, L, D)
    v = vc[meta.block_tables[0, 0]][:9].repeat_interleave(2, dim=1).transpose(0, 1)
    scores = query.transpose(0, 1) @ k.transpose(1, 2) * 0.2 + torch.full((9, 9), float("-inf")).triu(1)
    combined = torch.cat([scores, sinks[:, None, None].expand(-1, 9, 1)], dim=-1)
    probs = torch.softmax(combined - combined.amax(-1, keepdim=True), dim=-1)[..., :-1]
    torch.testing.assert_close(got, (probs @ v).transpose(0, 1), atol=1e-6, rtol=1e-6)


@pytest.mark.batch_invariant
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 32), (9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("window", [0, 21])
def test_rows_with_sinks_are_batch_and_chunk_invariant(heads, kv_heads, head_dim, window):
    seq_lens, rows = [33, 7, 120, 64], [1, 7, 30, 1]
    query, kc, vc, meta = _random_batch(seq_lens, rows, torch.bfloat16, heads=heads, kv_heads=kv_heads,
                                        head_dim=head_dim)
    sinks = _sinks(heads)
    batched = backend.paged_attention(query, kc, vc, meta, 0.17, window, sinks=sinks)
    start = 0
    for i, r in enumerate(rows):
        positions = meta.token_pos[start:start + r].tolist()
        alone = backend.paged_attention(query[start:start + r], kc, vc, _rows_meta(meta, i, positions), 0.17, window,
                                        sinks=sinks)
        assert torch.equal(alone, batched[start:start + r])
        for j, pos in enumerate(positions):  # one row at a time, as a prompt chunked by 1 would run
            one = backend.paged_attention(query[start + j:start + j + 1], kc, vc, _rows_meta(meta, i, [pos]), 0.17,
                                          window, sinks=sinks)
            assert torch.equal(one, batched[start + j:start + j + 1])
        start += r


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 32), (9, 3, 64), (4, 2, 128), (10, 1, 32)])
@pytest.mark.parametrize("k_type,v_type", [("q8_0", "q8_0"), ("q8_0", "bf16"), ("bf16", "q8_0")])
def test_sinks_with_q8_0_caches(heads, kv_heads, head_dim, k_type, v_type):
    seq_lens, rows = [5, 40, 17, 100], [5, 1, 17, 3]
    kc, vc, meta = _sequences(seq_lens, rows, kv_heads, head_dim, k_type, v_type)
    query, sinks = _query(sum(rows), heads, head_dim), _sinks(heads)
    scale = head_dim ** -0.5
    got = backend.paged_attention(query, kc, vc, meta, scale, 21, sinks=sinks)
    # with q rounded as the kernel rounds it for int8 keys, the reference is the kernel's formula
    q_used = _as_kernel_rounds_q(query) if k_type == "q8_0" else query.float()
    exact = reference_paged_attention(q_used, kc, vc, meta, scale, 21, sinks=sinks).to(torch.bfloat16)
    torch.testing.assert_close(got.float(), exact.float(), atol=1e-4, rtol=8e-3)
    assert (got.float() - backend.paged_attention(query, kc, vc, meta, scale, 21).float()).abs().max() > 5e-2
    for i in range(len(rows)):  # the last row of each sequence alone, bitwise
        last = sum(rows[:i + 1]) - 1
        one = AttentionMetadata(meta.slot_mapping, meta.block_tables[i:i + 1], torch.zeros(1, dtype=torch.int32),
                                meta.token_pos[last:last + 1], [seq_lens[i]], [1])
        assert torch.equal(backend.paged_attention(query[last:last + 1], kc, vc, one, scale, 21, sinks=sinks),
                           got[last:last + 1])


def test_sinks_must_name_every_query_head():
    query, kc, vc, meta = _random_batch([5], [1], torch.bfloat16)
    with pytest.raises(RuntimeError, match="sinks"):
        backend.paged_attention(query, kc, vc, meta, 0.1, sinks=torch.zeros(query.shape[1] - 1))
