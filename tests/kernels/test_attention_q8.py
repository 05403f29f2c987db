"""Attention over a q8_0 KV cache (int8 + fp16 scale per 32 values): the bytes written, the kernel against a
torch reference that dequantizes, and rows invariant to batch-mates and to how a prompt was chunked."""

import gguf
import pytest
import torch

from conveyor.kernels.attention import AttentionMetadata, reference_paged_attention, write_kv
from conveyor.kernels.kv_quant import dequantize_q8_0, quantize_q8_0, row_width
from conveyor.kernels.quant_ref import dequantize_raw
from tests.kernels.conftest import kernel_backend

backend = kernel_backend("attention", "fused_ops")
BLOCK_SIZE = 16


def _rows(n, kv_heads, head_dim, seed, dtype=torch.bfloat16, spread=0.5):
    gen = torch.Generator().manual_seed(seed)
    # Rows of different magnitudes (spread 2: orders of magnitude, some fp16 scales subnormal).
    scale = torch.exp(torch.randn(n, kv_heads, 1, generator=gen) * spread)
    return (torch.randn(n, kv_heads, head_dim, generator=gen) * scale).to(dtype)


def _caches(num_blocks, kv_heads, head_dim, k_type, v_type, dtype=torch.bfloat16):
    def one(kind):
        if kind == "q8_0":
            return torch.zeros(num_blocks, BLOCK_SIZE, kv_heads, row_width("q8_0", head_dim), dtype=torch.uint8)
        return torch.zeros(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype)
    return one(k_type), one(v_type)


def _sequences(seq_lens, rows_per_seq, kv_heads, head_dim, k_type="q8_0", v_type="q8_0", seed=0):
    """Caches filled through the kernel's write path; each sequence owns interleaved blocks; its last rows query."""
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 1
    kc, vc = _caches(num_blocks, kv_heads, head_dim, k_type, v_type)
    tables = torch.zeros(len(seq_lens), max(-(-n // BLOCK_SIZE) for n in seq_lens), dtype=torch.int32)
    order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
    token_seq, token_pos, used = [], [], 0
    for i, (n, r) in enumerate(zip(seq_lens, rows_per_seq)):
        need = -(-n // BLOCK_SIZE)
        tables[i, :need] = order[used:used + need].int()
        used += need
        slots = torch.tensor([int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)])
        backend.write_kv(kc, vc, _rows(n, kv_heads, head_dim, seed + 10 * i + 1),
                         _rows(n, kv_heads, head_dim, seed + 10 * i + 2), slots)
        token_seq += [i] * r
        token_pos += list(range(n - r, n))
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), block_tables=tables,
                             token_seq=torch.tensor(token_seq, dtype=torch.int32),
                             token_pos=torch.tensor(token_pos, dtype=torch.int32),
                             seq_lens=list(seq_lens), seq_token_counts=list(rows_per_seq))
    return kc, vc, meta


def _query(num_rows, heads, head_dim, seed=99):
    return torch.randn(num_rows, heads, head_dim, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _as_kernel_rounds_q(query):
    """The query as pass 1 uses it: int8 per 32-block with an fp32 scale (keys' scales are fp16, q's are not)."""
    blocks = query.float().reshape(*query.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, torch.ones_like(d) / d, torch.zeros_like(d))
    return (torch.round(blocks * inv).clamp(-127, 127) * d).reshape(query.shape)


def test_kernel_write_is_the_torch_twin_and_gguf_q8_0():
    rows = _rows(40, 2, 64, seed=3, spread=2)
    kc, vc = _caches(4, 2, 64, "q8_0", "bf16")
    slots = torch.randperm(4 * BLOCK_SIZE)[:40]
    backend.write_kv(kc, vc, rows, rows, slots)  # the C++ write
    got = kc.view(-1, 2, kc.shape[3])[slots]
    assert torch.equal(got, quantize_q8_0(rows))
    assert torch.equal(vc.view(-1, 2, 64)[slots], rows)  # the bf16 V next to it is stored as is
    torch_kc, torch_vc = _caches(4, 2, 64, "q8_0", "bf16")
    write_kv(torch_kc, torch_vc, rows, rows, slots)  # the torch fallback writes the same bytes
    assert torch.equal(torch_kc, kc)
    # The bytes are GGML Q8_0 blocks: gguf-py reads them as we do, within half a step of the input.
    ours = dequantize_q8_0(got)
    assert torch.equal(dequantize_raw(got.reshape(-1, got.shape[-1]), gguf.GGMLQuantizationType.Q8_0, 64),
                       ours.reshape(-1, 64))
    # Half a step, plus the fp16 rounding of d times |q| <= 127 (2^-11 relative, or 2^-25 absolute when subnormal).
    step = rows.float().abs().reshape(40, 2, 2, 32).amax(-1, keepdim=True) / 127
    bound = step * (0.5 + 127 * 2.0 ** -11) + 127 * 2.0 ** -25
    assert ((ours - rows.float()).reshape(40, 2, 2, 32).abs() <= bound).all()


def test_fused_rope_write_quantizes_the_rotated_key():
    T, H, KVH, D = 5, 4, 2, 64
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=gen).to(torch.bfloat16)
    angle = torch.rand(T, D // 2, generator=gen) * 6
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(torch.bfloat16)
    ssin = torch.cat([-angle.sin(), angle.sin()], -1).to(torch.bfloat16)
    slots = torch.tensor([3, 17, 18, 40, 63])
    plain = _caches(4, KVH, D, "bf16", "bf16")
    q_plain = backend.rope_write_kv(qkv, cos, ssin, *plain, slots, H)
    quant = _caches(4, KVH, D, "q8_0", "q8_0")
    q_quant = backend.rope_write_kv(qkv, cos, ssin, *quant, slots, H)
    assert torch.equal(q_plain, q_quant)
    for p, q in zip(plain, quant):
        assert torch.equal(q.view(-1, KVH, q.shape[3])[slots], quantize_q8_0(p.view(-1, KVH, D)[slots]))


# (heads, kv_heads, head_dim): the vector paths (1-4 query heads per KV head, 8 on pass 1) and the portable
# one (10 per KV head), one to eight 32-blocks per row (Gemma 3's 256: pass 1's tile holds 8 blocks per key).
SHAPES = [(6, 2, 32), (9, 3, 64), (4, 2, 128), (8, 2, 64), (8, 1, 64), (10, 1, 32), (16, 2, 64), (4, 1, 256)]


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("k_type,v_type", [("q8_0", "q8_0"), ("q8_0", "bf16"), ("bf16", "q8_0")])
@pytest.mark.parametrize("window", [0, 21, -16])  # -16: Llama 4's chunks of 16 positions
def test_kernel_matches_dequantized_reference(heads, kv_heads, head_dim, k_type, v_type, window):
    seq_lens, rows = [5, 40, 17, 100], [5, 1, 17, 3]
    kc, vc, meta = _sequences(seq_lens, rows, kv_heads, head_dim, k_type, v_type)
    query = _query(sum(rows), heads, head_dim)
    scale = head_dim ** -0.5
    got = backend.paged_attention(query, kc, vc, meta, scale, window)
    want = reference_paged_attention(query, kc, vc, meta, scale, window)  # fp32 over dequantized K/V, exact q
    # The kernel also rounds q to int8 per 32-block for q.k (as llama.cpp does): a small error on top of bf16's
    # (bounded here where a row sees many keys; a 16-position chunk averages too few for this bound).
    if window >= 0:
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    assert (got.float() - want.float()).abs().mean() < 3e-3
    # With q rounded as the kernel rounds it, the reference is the kernel's formula: equal up to fp32 order
    # and the output's bf16 rounding.
    q_used = _as_kernel_rounds_q(query) if k_type == "q8_0" else query.float()
    exact = reference_paged_attention(q_used, kc, vc, meta, scale, window).to(torch.bfloat16)
    torch.testing.assert_close(got.float(), exact.float(), atol=1e-4, rtol=8e-3)


@pytest.mark.parametrize("head_dim", [64, 576])  # the tiny MLA row; DeepSeek-V3's 512 + 64
def test_values_in_keys_one_q8_0_tensor_for_k_and_v(head_dim):
    """MLA's cache: one latent row per token (K and V the same q8_0 tensor), every query head on its one KV head."""
    seq_lens, rows = [5, 40, 17], [5, 1, 3]
    kc, _, meta = _sequences(seq_lens, rows, 1, head_dim)
    query = _query(sum(rows), 16, head_dim)
    scale = head_dim ** -0.5
    got = backend.paged_attention(query, kc, kc, meta, scale, 0)
    exact = reference_paged_attention(_as_kernel_rounds_q(query), kc, kc, meta, scale, 0).to(torch.bfloat16)
    torch.testing.assert_close(got.float(), exact.float(), atol=1e-4, rtol=8e-3)


def test_soft_capping_with_q8_0():
    kc, vc, meta = _sequences([30, 70], [2, 1], 2, 64)
    query = _query(3, 6, 64)
    got = backend.paged_attention(query, kc, vc, meta, 0.125, 0, 1.5)
    want = reference_paged_attention(query, kc, vc, meta, 0.125, 0, softcap=1.5)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.batch_invariant
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (10, 1, 32), (12, 2, 64), (4, 1, 256)])
def test_rows_alone_equal_rows_in_a_batch_of_16(heads, kv_heads, head_dim):
    seq_lens = [7 + 37 * i for i in range(16)]
    kc, vc, meta = _sequences(seq_lens, [1] * 16, kv_heads, head_dim)
    query = _query(16, heads, head_dim)
    batched = backend.paged_attention(query, kc, vc, meta, 0.17)
    for i in range(16):
        one = AttentionMetadata(meta.slot_mapping, meta.block_tables[i:i + 1], torch.zeros(1, dtype=torch.int32),
                                meta.token_pos[i:i + 1], [seq_lens[i]], [1])
        assert torch.equal(backend.paged_attention(query[i:i + 1], kc, vc, one, 0.17), batched[i:i + 1])


@pytest.mark.batch_invariant
@pytest.mark.parametrize("k_type,v_type", [("q8_0", "q8_0"), ("q8_0", "bf16")])
def test_prefill_in_chunks_of_1_7_or_all_is_bitwise_the_same(k_type, v_type):
    """Write each chunk's K/V, then attend its rows: outputs and cache bytes never depend on the chunk size."""
    n, heads, kv_heads, head_dim = 45, 9, 3, 64
    keys, values = _rows(n, kv_heads, head_dim, seed=5), _rows(n, kv_heads, head_dim, seed=6)
    query = _query(n, heads, head_dim)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)])
    results = []
    for chunk in (1, 7, n):
        kc, vc = _caches(4, kv_heads, head_dim, k_type, v_type)
        outs = []
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            backend.write_kv(kc, vc, keys[start:end], values[start:end], slots[start:end])
            meta = AttentionMetadata(slots[start:end], table, torch.zeros(end - start, dtype=torch.int32),
                                     torch.arange(start, end, dtype=torch.int32), [end], [end - start])
            outs.append(backend.paged_attention(query[start:end], kc, vc, meta, head_dim ** -0.5, 0))
        results.append((torch.cat(outs), kc, vc))
    for out, kc, vc in results[1:]:
        assert torch.equal(out, results[0][0])
        assert torch.equal(kc, results[0][1]) and torch.equal(vc, results[0][2])


def test_refuses_a_row_that_is_not_whole_blocks():
    kc, vc = _caches(2, 1, 32, "q8_0", "q8_0")
    meta = AttentionMetadata(torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32),
                             torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), [1], [1])
    with pytest.raises(RuntimeError, match="head_dim"):
        backend.paged_attention(_query(1, 2, 48), kc[..., :51].contiguous(), vc[..., :51].contiguous(), meta, 0.1)


@pytest.mark.parametrize("window", [0, 21])
def test_key_end_over_q8_0(window):
    """Gemma 3's image rows (key_end past their position) over a q8_0 cache: the reference's formula."""
    seq_lens, rows = [60, 40], [20, 1]
    kc, vc, meta = _sequences(seq_lens, rows, 2, 64)
    ends = (meta.token_pos + 1).clone()
    ends[4:12] = 40 + 12  # sequence 0's positions 44..51: one run ending at 52
    meta.key_end = ends
    query = _query(sum(rows), 4, 64)
    got = backend.paged_attention(query, kc, vc, meta, 64 ** -0.5, window)
    exact = reference_paged_attention(_as_kernel_rounds_q(query), kc, vc, meta, 64 ** -0.5, window)
    torch.testing.assert_close(got.float(), exact.to(torch.bfloat16).float(), atol=1e-4, rtol=8e-3)
    meta.key_end = None
    plain = backend.paged_attention(query, kc, vc, meta, 64 ** -0.5, window)
    assert torch.equal(got[:4], plain[:4]) and not torch.equal(got[4:12], plain[4:12])
