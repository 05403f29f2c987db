"""The amx build's paged attention on AMX tiles (csrc/paged_amx.h): against a float64 reference, and each row's
bits independent of its tile-mates, batch-mates and chunking: a prompt's rows computed in one call, in chunks of
3 and 17 and one at a time (decode) are the same bits, with garbage (NaN, inf) in every cache slot a row must not
read. Skipped where the process does not take that path (another level, CONVEYOR_DISABLE_AMX, CONVEYOR_PAGED_AMX=0)."""

import random

import pytest
import torch

from conveyor.kernels.attention import AttentionMetadata
from tests.kernels.conftest import kernel_backend

backend = kernel_backend("attention")
if backend.attention.paged_attention_path(64) != "amx":
    pytest.skip("paged attention takes the row path in this process", allow_module_level=True)

BLOCK_SIZE = 16


def _sequences(lens, kv_heads, head_dim, block_size=BLOCK_SIZE, seed=0):
    """K/V caches where sequence i owns shuffled blocks; every slot a sequence does not own holds NaN / inf."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum((n + block_size - 1) // block_size for n in lens) + 4
    shape = (num_blocks, block_size, kv_heads, head_dim)
    garbage = torch.full(shape, float("nan"))
    garbage[::2] = float("inf")
    kc, vc = garbage.clone(), garbage.clone()
    blocks = list(range(num_blocks))
    random.Random(seed).shuffle(blocks)
    tables = torch.zeros(len(lens), max((n + block_size - 1) // block_size for n in lens), dtype=torch.int32)
    for i, n in enumerate(lens):
        need = (n + block_size - 1) // block_size
        tables[i, :need] = torch.tensor([blocks.pop() for _ in range(need)])
        for p in range(n):
            b, off = tables[i, p // block_size], p % block_size
            kc[b, off] = torch.randn(kv_heads, head_dim, generator=gen)
            vc[b, off] = torch.randn(kv_heads, head_dim, generator=gen)
    return kc.bfloat16(), vc.bfloat16(), tables


def _meta(tables, rows):
    """rows: (sequence, position) per query row, in call order."""
    seq = torch.tensor([s for s, _ in rows], dtype=torch.int32)
    pos = torch.tensor([p for _, p in rows], dtype=torch.int32)
    return AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), block_tables=tables, token_seq=seq,
                             token_pos=pos, seq_lens=[], seq_token_counts=[])


def _reference64(query, kc, vc, tables, rows, scale, window=0, softcap=0.0, sinks=None):
    """float64 softmax attention of each row over its visible keys, read through the block table."""
    block_size, kv_heads = kc.shape[1], kc.shape[2]
    group = query.shape[1] // kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for r, (s, p) in enumerate(rows):
        first = max(0, p + 1 - window) if window > 0 else (p // -window) * -window if window < 0 else 0
        keys = torch.arange(first, p + 1)
        slots = tables[s, keys // block_size].long() * block_size + keys % block_size
        k = kc.view(-1, kv_heads, kc.shape[3])[slots].double()  # (L, KVH, D)
        v = vc.view(-1, kv_heads, vc.shape[3])[slots].double()
        for h in range(query.shape[1]):
            scores = k[:, h // group] @ query[r, h].double() * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks is not None:
                scores = torch.cat([scores, sinks[h:h + 1].double()])
            probs = torch.softmax(scores, 0)[:len(keys)]
            out[r, h] = probs @ v[:, h // group]
    return out


# (heads, kv_heads, head_dim): 1B Llama's group of 4, one head per KV head, 3 (a tile straddles tokens), 8, more
# heads than a tile's rows, and head dims 32, 128, 256, 16 and 48 (zero columns up to 32 d)
SHAPES = [(8, 2, 64), (2, 2, 64), (6, 2, 32), (16, 2, 128), (20, 1, 64), (4, 1, 256), (4, 2, 16), (6, 3, 48)]


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("window", [0, 21, -64])
def test_matches_float64_reference(heads, kv_heads, head_dim, window):
    lens = [1, 70, 200]
    kc, vc, tables = _sequences(lens, kv_heads, head_dim)
    rows = [(0, 0), (1, 5), (1, 63), (1, 64), (1, 69), (2, 130), (2, 199)]
    query = torch.randn(len(rows), heads, head_dim, generator=torch.Generator().manual_seed(1)).bfloat16()
    scale = head_dim ** -0.5
    got = backend.paged_attention(query, kc, vc, _meta(tables, rows), scale, window)
    want = _reference64(query, kc, vc, tables, rows, scale, window)
    # bf16 probabilities and a bf16 output: within ~3 bf16 steps of values of order 1
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


def test_softcap_and_sinks_match_float64_reference():
    lens = [150]
    kc, vc, tables = _sequences(lens, 2, 64)
    rows = [(0, p) for p in (0, 31, 64, 149)]
    query = torch.randn(len(rows), 8, 64, generator=torch.Generator().manual_seed(2)).bfloat16() * 3
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(3)) + 1
    for softcap, sink in ((1.5, None), (0.0, sinks), (2.0, sinks)):
        got = backend.paged_attention(query, kc, vc, _meta(tables, rows), 0.125, 0, softcap=softcap, sinks=sink)
        want = _reference64(query, kc, vc, tables, rows, 0.125, softcap=softcap, sinks=sink)
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("window", [0, 21])
@pytest.mark.parametrize("block_size", [16, 4])
def test_prefill_chunks_and_decode_give_the_same_bits(heads, kv_heads, head_dim, window, block_size):
    """One prompt's rows in one call, in chunks of 3 and 17, and one at a time, beside another sequence's rows; the
    slots after a chunk hold garbage, as the pool's unwritten slots may."""
    n = 150
    kc, vc, tables = _sequences([n, 90], kv_heads, head_dim, block_size)
    query = torch.randn(n, heads, head_dim, generator=torch.Generator().manual_seed(4)).bfloat16()
    other = torch.randn(5, heads, head_dim, generator=torch.Generator().manual_seed(5)).bfloat16()
    scale = head_dim ** -0.5

    def run(chunk):
        outs = []
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            # garbage where this chunk's prefill would not have written yet
            k, v = kc.clone(), vc.clone()
            for p in range(stop, n):
                b, off = tables[0, p // block_size], p % block_size
                k[b, off], v[b, off] = float("nan"), float("inf")
            rows = [(1, 85 + i) for i in range(5)] + [(0, p) for p in range(start, stop)]
            q = torch.cat([other, query[start:stop]])
            outs.append(backend.paged_attention(q, k, v, _meta(tables, rows), scale, window)[5:])
        return torch.cat(outs)

    whole = run(n)
    assert torch.isfinite(whole.float()).all()
    for chunk in (3, 17, 1):
        assert torch.equal(run(chunk), whole), chunk


def test_key_end_rows_are_the_same_bits_alone():
    """Gemma 3's image rows (key_end past their own position) alone == beside causal rows in one call."""
    kc, vc, tables = _sequences([100], 2, 64)
    rows = [(0, p) for p in range(40, 60)]
    query = torch.randn(len(rows), 4, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    meta = _meta(tables, rows)
    meta.key_end = torch.tensor([p + 1 if p < 45 else 60 for _, p in rows], dtype=torch.int32)
    both = backend.paged_attention(query, kc, vc, meta, 0.125, 0)
    for r in range(len(rows)):
        one = _meta(tables, rows[r:r + 1])
        one.key_end = meta.key_end[r:r + 1]
        assert torch.equal(backend.paged_attention(query[r:r + 1], kc, vc, one, 0.125, 0), both[r:r + 1])
