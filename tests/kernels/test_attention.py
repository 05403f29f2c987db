import os
import random
import subprocess
import sys

import pytest
import torch

from conveyor.kernels.attention import AttentionMetadata, reference_paged_attention, write_kv
from tests.kernels.conftest import kernel_backend

backend = kernel_backend("attention")
paged_attention = backend.paged_attention

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM = 64, 16, 2, 6, 32


def _random_batch(seq_lens, rows_per_seq, dtype, seed=0, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                  num_blocks=NUM_BLOCKS):
    """Random paged caches plus metadata where sequence i owns shuffled blocks and its last rows query."""
    gen = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    blocks = list(range(num_blocks))
    random.Random(seed).shuffle(blocks)
    max_blocks = max((n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in seq_lens)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    token_seq, token_pos = [], []
    for i, (n, r) in enumerate(zip(seq_lens, rows_per_seq)):
        need = (n + BLOCK_SIZE - 1) // BLOCK_SIZE
        tables[i, :need] = torch.tensor([blocks.pop() for _ in range(need)])
        token_seq += [i] * r
        token_pos += list(range(n - r, n))
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), block_tables=tables,
                             token_seq=torch.tensor(token_seq, dtype=torch.int32),
                             token_pos=torch.tensor(token_pos, dtype=torch.int32),
                             seq_lens=list(seq_lens), seq_token_counts=list(rows_per_seq))
    query = torch.randn(len(token_seq), heads, head_dim, generator=gen).to(dtype)
    return query, key_cache, value_cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 7, -8])  # -8: chunks of 8 positions (Llama 4)
def test_kernel_matches_reference(dtype, window):
    query, kc, vc, meta = _random_batch([5, 40, 17, 100], [5, 1, 17, 3], dtype)
    got = paged_attention(query, kc, vc, meta, scale=HEAD_DIM ** -0.5, window=window)
    want = reference_paged_attention(query, kc, vc, meta, scale=HEAD_DIM ** -0.5, window=window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_scores_match_reference_and_stay_row_invariant(dtype):
    # Gemma 2: scores = c * tanh(scores / c) before the softmax; a small cap so it changes the result.
    query, kc, vc, meta = _random_batch([5, 40, 17, 100], [5, 1, 17, 3], dtype)
    scale, cap = HEAD_DIM ** -0.5, 1.5
    got = paged_attention(query, kc, vc, meta, scale=scale, window=7, softcap=cap)
    want = reference_paged_attention(query, kc, vc, meta, scale=scale, window=7, softcap=cap)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    uncapped = paged_attention(query, kc, vc, meta, scale=scale, window=7)
    assert not torch.allclose(got, uncapped, atol=1e-3)
    one = AttentionMetadata(meta.slot_mapping, meta.block_tables[3:4], torch.zeros(1, dtype=torch.int32),
                            meta.token_pos[-1:], [100], [1])
    assert torch.equal(paged_attention(query[-1:], kc, vc, one, scale=scale, window=7, softcap=cap), got[-1:])


# SmolLM2's shape (64-dim heads, 3 query heads per KV head) and a 128-dim one take the
# transposed vdpbf16ps path for q.k on AVX-512 BF16 CPUs; key counts straddle groups of 16.
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128)])
@pytest.mark.parametrize("window", [0, 21, -16])
def test_wide_heads_match_reference_and_stay_invariant(heads, kv_heads, head_dim, window):
    seq_lens, rows = [5, 40, 17, 100], [5, 1, 17, 3]
    query, kc, vc, meta = _random_batch(seq_lens, rows, torch.bfloat16, heads=heads, kv_heads=kv_heads,
                                        head_dim=head_dim)
    got = paged_attention(query, kc, vc, meta, scale=head_dim ** -0.5, window=window)
    want = reference_paged_attention(query, kc, vc, meta, scale=head_dim ** -0.5, window=window)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    start = 0
    for i, r in enumerate(rows):  # every row alone == the same row in the batch
        for j in range(r):
            one = AttentionMetadata(meta.slot_mapping, meta.block_tables[i:i + 1], torch.zeros(1, dtype=torch.int32),
                                    meta.token_pos[start + j:start + j + 1], [seq_lens[i]], [1])
            alone = paged_attention(query[start + j:start + j + 1], kc, vc, one, scale=head_dim ** -0.5,
                                    window=window)
            assert torch.equal(alone, got[start + j:start + j + 1])
        start += r


def test_kernel_rows_are_batch_and_chunk_invariant():
    """A row's output is bitwise the same alone, in any batch, and under any prefill split."""
    seq_lens, rows = [33, 7, 120, 64], [1, 7, 30, 1]
    query, kc, vc, meta = _random_batch(seq_lens, rows, torch.bfloat16)
    batched = paged_attention(query, kc, vc, meta, scale=0.17)
    start = 0
    for i, r in enumerate(rows):
        single = AttentionMetadata(meta.slot_mapping, meta.block_tables[i:i + 1], torch.zeros(r, dtype=torch.int32),
                                   meta.token_pos[start:start + r], [seq_lens[i]], [r])
        alone = paged_attention(query[start:start + r], kc, vc, single, scale=0.17)
        assert torch.equal(alone, batched[start:start + r])
        # Each row alone (as if the prompt had been chunked one token at a time).
        for j in range(r):
            one = AttentionMetadata(meta.slot_mapping, meta.block_tables[i:i + 1], torch.zeros(1, dtype=torch.int32),
                                    meta.token_pos[start + j:start + j + 1], [seq_lens[i]], [1])
            assert torch.equal(paged_attention(query[start + j:start + j + 1], kc, vc, one, scale=0.17),
                               batched[start + j:start + j + 1])
        start += r


def test_write_kv_places_rows_in_slots():
    kc = torch.zeros(4, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    vc = torch.zeros_like(kc)
    key = torch.randn(3, KV_HEADS, HEAD_DIM)
    slots = torch.tensor([0, BLOCK_SIZE + 2, 3 * BLOCK_SIZE + 15])
    write_kv(kc, vc, key, -key, slots)
    assert torch.equal(kc[1, 2], key[1]) and torch.equal(vc[3, 15], -key[2]) and torch.equal(kc[0, 0], key[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_sdpa_path_matches_the_reference(dtype):
    """The GPU path (SDPA over the gathered copy, in the activation dtype), run here on CPU tensors."""
    query, kc, vc, meta = _random_batch([5, 40, 17], [5, 1, 17], dtype)
    want = reference_paged_attention(query, kc, vc, meta, scale=HEAD_DIM ** -0.5, window=7)
    got = reference_paged_attention(query, kc, vc, meta, scale=HEAD_DIM ** -0.5, window=7, fused=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def _rows_meta(meta, seq, positions):
    """Metadata for rows of sequence `seq` at `positions` alone (one prefill chunk, or decode rows)."""
    n = len(positions)
    return AttentionMetadata(meta.slot_mapping, meta.block_tables[seq:seq + 1], torch.zeros(n, dtype=torch.int32),
                             torch.tensor(positions, dtype=torch.int32), [max(positions) + 1], [n])


# Key counts straddling the vector paths' groups (8 keys on AVX2, 16 on AVX-512 BF16) and their
# register-blocked shapes: query heads per KV head 1-4, head dims 64 and 128 (9/3/64 is SmolLM2-135M);
# 256 (Gemma 3, Qwen3.5; AVX2's blocked path); more than 4 query heads per KV head, run in sub-groups
# (8: GPT-OSS, 4 + 4; 6: 3 + 3; 5: one at a time).
STRADDLING_LENS = [1, 2, 7, 8, 9, 15, 16, 17, 23, 24, 25, 31, 33, 135]


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 64), (6, 3, 64), (8, 2, 64), (3, 3, 128),
                                                     (4, 2, 128), (6, 2, 128), (12, 3, 128), (16, 2, 64),
                                                     (12, 2, 64), (10, 2, 64), (4, 1, 256), (6, 2, 256),
                                                     (16, 2, 128)])
def test_wide_heads_at_every_group_boundary(heads, kv_heads, head_dim):
    seq_lens = STRADDLING_LENS
    rows = [min(n, 3) for n in seq_lens]  # the last rows of each: key counts n-2, n-1, n
    query, kc, vc, meta = _random_batch(seq_lens, rows, torch.bfloat16, seed=5, heads=heads, kv_heads=kv_heads,
                                        head_dim=head_dim, num_blocks=48)
    scale = head_dim ** -0.5
    got = paged_attention(query, kc, vc, meta, scale=scale)
    want = reference_paged_attention(query, kc, vc, meta, scale=scale)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    start = 0
    for i, r in enumerate(rows):  # each row alone, as a decode row would run
        for j in range(r):
            pos = int(meta.token_pos[start + j])
            alone = paged_attention(query[start + j:start + j + 1], kc, vc, _rows_meta(meta, i, [pos]), scale=scale)
            assert torch.equal(alone, got[start + j:start + j + 1]), (seq_lens[i], pos)
        start += r


# G = 1, 2, 3, 4 query heads per KV head take blocks of 12, 6, 4, 3 prefill rows at AVX-512 BF16 (the row path's
# scores_dpbf16_pre_rows / weighted_sum_pre_rows), with the leftover rows one by one.
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (16, 2, 64), (8, 2, 256), (4, 4, 64),
                                                     (6, 3, 128)])
def test_wide_heads_prefill_chunking_is_invisible(heads, kv_heads, head_dim):
    """A 70-token prompt prefilled whole, in uneven chunks next to other sequences, or one row at a
    time: every row bitwise the same."""
    seq_lens = [70, 19, 40]
    query, kc, vc, meta = _random_batch(seq_lens, [70, 1, 5], torch.bfloat16, seed=6, heads=heads,
                                        kv_heads=kv_heads, head_dim=head_dim)
    scale = head_dim ** -0.5
    whole = paged_attention(query[:70], kc, vc, _rows_meta(meta, 0, list(range(70))), scale=scale)
    batched = paged_attention(query, kc, vc, meta, scale=scale)
    assert torch.equal(batched[:70], whole)
    for chunks in ([3, 13, 1, 37, 16], [8, 8, 9, 45], [70]):
        start = 0
        for size in chunks:  # each chunk shares its call with the other sequences' rows
            rows = list(range(start, start + size))
            q = torch.cat([query[start:start + size], query[70:]])
            m = AttentionMetadata(meta.slot_mapping, meta.block_tables,
                                  torch.tensor([0] * size + [1] + [2] * 5, dtype=torch.int32),
                                  torch.cat([torch.tensor(rows, dtype=torch.int32), meta.token_pos[70:]]),
                                  [start + size, 19, 40], [size, 1, 5])
            out = paged_attention(q, kc, vc, m, scale=scale)
            assert torch.equal(out[:size], whole[start:start + size]), (chunks, start)
            assert torch.equal(out[size:], batched[70:])
            start += size
    for pos in (0, 7, 8, 15, 16, 69):
        assert torch.equal(paged_attention(query[pos:pos + 1], kc, vc, _rows_meta(meta, 0, [pos]), scale=scale),
                           whole[pos:pos + 1])


# Fan-out requests on one prompt: the prefix cache hands every sequence the same first blocks. At AVX-512 BF16 a call
# prepares such a shared prefix once (whole 16-key groups every member's rows see) and the members' rows read it, in
# blocks of 12 / G rows (G = 2, 3, 4 here: 7 rows of the first group) and one by one.
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (8, 4, 64), (16, 2, 64), (4, 4, 64),
                                                     (6, 3, 128), (4, 1, 256), (9, 3, 32)])
@pytest.mark.parametrize("window", [0, 40])
def test_rows_on_shared_prefix_blocks_match_each_row_alone(heads, kv_heads, head_dim, window):
    """Sequences whose tables share leading blocks (the whole prompt, part of it, one block, or the same blocks and
    then different ones), decode and verify rows beside a prefill chunk: every row bitwise equal to it alone, and to
    the reference."""
    seq_lens = [150, 137, 201, 96, 150, 40, 180, 19]
    rows = [1, 1, 4, 1, 20, 1, 2, 1]
    query, kc, vc, meta = _random_batch(seq_lens, rows, torch.bfloat16, seed=11, heads=heads, kv_heads=kv_heads,
                                        head_dim=head_dim, num_blocks=96)
    tables = meta.block_tables.clone()
    tables[1, :8] = tables[0, :8]  # 137 keys: the first 128 shared with sequence 0
    tables[2, :9] = tables[0, :9]  # 201 keys: 144 shared
    tables[3, :6] = tables[0, :6]  # 96 keys: its whole prompt (6 blocks) is sequence 0's
    tables[4, :9] = tables[0, :9]  # a 20-row chunk of a prepared sequence that shares blocks too
    tables[6, :3] = tables[5, :3]  # another group: 40 keys, 3 blocks of which 2 are whole below every row
    tables[7, :1] = tables[0, :1]  # one block: fewer than the shortest shared prefix
    meta = AttentionMetadata(meta.slot_mapping, tables, meta.token_seq, meta.token_pos, meta.seq_lens,
                             meta.seq_token_counts)
    scale = head_dim ** -0.5
    got = paged_attention(query, kc, vc, meta, scale=scale, window=window)
    want = reference_paged_attention(query, kc, vc, meta, scale=scale, window=window)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    start = 0
    for i, r in enumerate(rows):
        for j in range(r):
            pos = int(meta.token_pos[start + j])
            alone = paged_attention(query[start + j:start + j + 1], kc, vc, _rows_meta(meta, i, [pos]), scale=scale,
                                    window=window)
            assert torch.equal(alone, got[start + j:start + j + 1]), (i, pos)
        start += r


@pytest.mark.parametrize("block_size", [8, 32])
def test_shared_prefix_rows_at_other_block_sizes(block_size):
    """Blocks of 8 and 32 tokens: a prefix shared over whole blocks (and one shared over fewer keys, which shortens the
    group's prefix), decode and verify rows and a key_end row: each row as it is alone."""
    gen = torch.Generator().manual_seed(block_size)
    lens, rows = [300, 280, 310, 150], [1, 1, 2, 1]
    per_seq = -(-max(lens) // block_size)
    kc = torch.randn(4 * per_seq, block_size, 2, 64, generator=gen).bfloat16()
    vc = torch.randn(4 * per_seq, block_size, 2, 64, generator=gen).bfloat16()
    tables = torch.tensor([[s * per_seq + i for i in range(per_seq)] for s in range(4)], dtype=torch.int32)
    tables[1:3, :256 // block_size] = tables[0, :256 // block_size]
    tables[3, :96 // block_size] = tables[0, :96 // block_size]
    seq = torch.tensor([0, 1, 2, 2, 3], dtype=torch.int32)
    pos = torch.tensor([299, 279, 308, 309, 149], dtype=torch.int32)
    ends = pos + 1
    ends[3] = 310  # a bidirectional run's row (Gemma 3's images) sees one key past its own
    query = torch.randn(5, 8, 64, generator=gen).bfloat16()
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), tables, seq, pos, lens, rows, key_end=ends)
    got = paged_attention(query, kc, vc, meta, scale=0.125)
    torch.testing.assert_close(got, reference_paged_attention(query, kc, vc, meta, scale=0.125), atol=2e-2, rtol=2e-2)
    for t in range(5):
        s = int(seq[t])
        alone = AttentionMetadata(torch.zeros(0, dtype=torch.long), tables[s:s + 1], torch.zeros(1, dtype=torch.int32),
                                  pos[t:t + 1], [int(ends[t])], [1], key_end=ends[t:t + 1])
        assert torch.equal(paged_attention(query[t:t + 1], kc, vc, alone, scale=0.125), got[t:t + 1]), t


def _two_families(path: str) -> None:
    """In a fresh subprocess: six decode rows of 200 keys, two families of three whose tables share 10 blocks within the
    family but only the first block across (one chat template's first tokens); saves the outputs, each row alone, and
    this thread's prepass scratch (bytes, cap)."""
    query, kc, vc, meta = _random_batch([200] * 6, [1] * 6, torch.bfloat16, seed=13, heads=4, kv_heads=2, head_dim=64,
                                        num_blocks=96)
    meta.block_tables[1:6, :1] = meta.block_tables[0, :1]
    meta.block_tables[1:3, 1:10] = meta.block_tables[0, 1:10]
    meta.block_tables[4:6, 1:10] = meta.block_tables[3, 1:10]
    got = paged_attention(query, kc, vc, meta, scale=0.125)
    scratch = backend.attention.row_prepass_bytes()
    alone = [paged_attention(query[i:i + 1], kc, vc, _rows_meta(meta, i, [199]), scale=0.125) for i in range(6)]
    torch.save({"got": got, "alone": torch.cat(alone), "scratch": scratch, "isa": backend.attention.isa()}, path)


def test_prompts_that_begin_alike_form_a_group_each(tmp_path):
    """Two families of requests whose prompts share only their first block across families: each family's prefix is
    prepared (2 groups x 2 KV heads x 160 keys x 128 B of transposed keys where the prepass runs), and every row is as
    it is alone."""
    path = tmp_path / "families.pt"
    env = {**os.environ, "CONVEYOR_PAGED_AMX": "0"}
    env.pop("CONVEYOR_ROW_PREPASS_BYTES", None)
    code = f"import tests.kernels.test_attention as t; t._two_families({str(path)!r})"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    saved = torch.load(path)
    assert torch.equal(saved["got"], saved["alone"])
    scratch, cap = saved["scratch"]
    if cap:  # the AVX-512 levels' row path (the others have no prepass)
        assert scratch == 2 * 2 * 160 * 2 * 64, saved["isa"]


def test_a_call_after_shared_prefix_rows_reads_nothing_of_theirs():
    """A call that prepares a shared prefix, then calls on the same blocks that prepare nothing (8 query heads per KV
    head, sub-groups; a sliding window): each row as it is alone, and as the reference."""
    seq_lens, rows = [150, 140, 160], [1, 1, 1]
    for heads, window in ((4, 0), (16, 0), (4, 30), (4, 0)):
        query, kc, vc, meta = _random_batch(seq_lens, rows, torch.bfloat16, seed=12, heads=heads, kv_heads=2,
                                            head_dim=64, num_blocks=48)
        meta.block_tables[1:, :8] = meta.block_tables[0, :8]
        got = paged_attention(query, kc, vc, meta, scale=0.125, window=window)
        torch.testing.assert_close(got, reference_paged_attention(query, kc, vc, meta, scale=0.125, window=window),
                                   atol=2e-2, rtol=2e-2)
        for i in range(3):
            alone = paged_attention(query[i:i + 1], kc, vc, _rows_meta(meta, i, [seq_lens[i] - 1]), scale=0.125,
                                    window=window)
            assert torch.equal(alone, got[i:i + 1]), (heads, window, i)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128), (6, 2, 32)])
def test_keys_past_a_row_are_never_read(heads, kv_heads, head_dim):
    """Cache slots no row may see (past each sequence's end, unowned blocks) hold NaN: no output changes (20 rows of
    one sequence: a prefill's keys prepared once per call)."""
    seq_lens, rows = [9, 17, 135, 1], [1, 2, 20, 1]
    query, kc, vc, meta = _random_batch(seq_lens, rows, torch.bfloat16, seed=7, heads=heads, kv_heads=kv_heads,
                                        head_dim=head_dim)
    clean = paged_attention(query, kc, vc, meta, scale=0.125)
    visible = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, dtype=torch.bool)
    for i, n in enumerate(seq_lens):
        for key in range(n):
            visible[meta.block_tables[i, key // BLOCK_SIZE], key % BLOCK_SIZE] = True
    kc_nan, vc_nan = kc.clone(), vc.clone()
    kc_nan[~visible] = float("nan")
    vc_nan[~visible] = float("nan")
    assert torch.equal(paged_attention(query, kc_nan, vc_nan, meta, scale=0.125), clean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 7])
def test_key_end_rows_see_their_run_both_ways(dtype, window):
    """key_end (Gemma 3's image rows): a row sees keys up to its run's end, its window still starts from its own
    position; equal to the reference, and a row's output is the same alone as in the batch."""
    seq_lens, rows = [30, 40, 12], [12, 1, 12]
    query, kc, vc, meta = _random_batch(seq_lens, rows, dtype)
    ends = (meta.token_pos + 1).clone()
    ends[3:9] = 18 + 9 - 3  # sequence 0's rows at positions 21..26 form one run, ending at 27
    ends[13 + 2:13 + 6] = 6  # sequence 2's positions 2..5
    meta.key_end = ends
    got = paged_attention(query, kc, vc, meta, scale=HEAD_DIM ** -0.5, window=window)
    want = reference_paged_attention(query, kc, vc, meta, scale=HEAD_DIM ** -0.5, window=window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    plain = paged_attention(query, kc, vc, AttentionMetadata(**{**meta.__dict__, "key_end": None}),
                            scale=HEAD_DIM ** -0.5, window=window)
    assert torch.equal(got[:3], plain[:3]) and not torch.equal(got[3:9], plain[3:9])
    single = AttentionMetadata(meta.slot_mapping, meta.block_tables[:1], torch.zeros(1, dtype=torch.int32),
                               meta.token_pos[5:6], [seq_lens[0]], [1], key_end=ends[5:6])
    assert torch.equal(paged_attention(query[5:6], kc, vc, single, scale=HEAD_DIM ** -0.5, window=window), got[5:6])


def _capped_prefill(path: str) -> None:
    """In a subprocess under CONVEYOR_ROW_PREPASS_BYTES: a call with two prefill chunks (300 and 100 keys, 40 and 20
    rows) and a decode row, twice; saves the outputs and this thread's prepass scratch and cap (bytes)."""
    query, kc, vc, meta = _random_batch([300, 100, 50], [40, 20, 1], torch.bfloat16, seed=9, heads=4, kv_heads=2,
                                        head_dim=64)
    outs = [paged_attention(query, kc, vc, meta, scale=0.125) for _ in range(2)]
    torch.save({"outs": outs, "scratch": backend.attention.row_prepass_bytes(), "isa": backend.attention.isa()}, path)


def _prepared_bytes(isa: str, cap: int) -> int:
    """The row path's prepared bytes for _capped_prefill's two chunks (2 KV heads, D = 64) under `cap`, in order, each
    that still fits: keys 2 x 16-key groups x 2 KB, and with BF16 (the amx build's row path too) values 2 x key pairs
    x 256 B (two bf16 rows interleaved); without BF16 keys only."""
    values = isa in ("avx512_bf16", "amx")
    used = 0
    for groups, pairs in ((19, 150), (7, 50)):
        size = 2 * groups * 2048 + (2 * pairs * 256 if values else 0)
        if used + size <= cap:
            used += size
    return used


@pytest.mark.parametrize("cap", [1000, 100_000])  # neither chunk fits; one of the two (the second with values)
def test_row_prepass_cap_keeps_the_bits_and_bounds_the_scratch(cap, tmp_path):
    """The row path (CONVEYOR_PAGED_AMX=0) with the prepass capped below one chunk, and below the first of two: the
    same bits as uncapped, and the scratch kept across calls within the cap."""
    def run(env_cap):
        path = tmp_path / f"{env_cap}.pt"
        env = {**os.environ, "CONVEYOR_PAGED_AMX": "0"}
        env.pop("CONVEYOR_ROW_PREPASS_BYTES", None)
        if env_cap is not None:
            env["CONVEYOR_ROW_PREPASS_BYTES"] = str(env_cap)
        code = f"import tests.kernels.test_attention as t; t._capped_prefill({str(path)!r})"
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        return torch.load(path)

    capped, full = run(cap), run(None)
    for out in capped["outs"] + full["outs"][1:]:
        assert torch.equal(out, full["outs"][0])
    scratch, limit = capped["scratch"]
    if limit == 0:  # no prepass at this level (AVX2, portable): the per-row passes only
        return
    assert limit == cap and scratch == _prepared_bytes(capped["isa"], cap)
    assert full["scratch"] == (_prepared_bytes(full["isa"], 64 << 20), 64 << 20)
