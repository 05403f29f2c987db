"""Running an encoder (models/modernbert.py, nomic_bert.py) the way the runner does, for comparisons with
transformers: whole sequences in one forward over a paged cache, every row's token_pos its sequence's last."""

from __future__ import annotations

import random

import tokenizers
import torch

from conveyor.kernels import AttentionMetadata

VOCAB = 300
BLOCK = 4
NUM_BLOCKS = 128


def write_dir(model, path) -> str:
    """save_pretrained plus a word-level tokenizer over VOCAB ids (t0, t1, ...)."""
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.save(str(path / "tokenizer.json"))
    return str(path)


def block_tables(lengths: list[int], seed: int) -> list[list[int]]:
    """Scattered blocks, different for each seed."""
    free = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    tables = []
    for n in lengths:
        count = (n + BLOCK - 1) // BLOCK
        tables.append(free[:count])
        free = free[count:]
    return tables


def bidirectional_metadata(lengths: list[int], tables: list[list[int]]) -> AttentionMetadata:
    """One forward's metadata over these sequences (the encoders read only seq_token_counts; every row's token_pos
    is its sequence's last position, as a bidirectional reader of the paged cache would need)."""
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for n, table in zip(lengths, tables) for p in range(n)]
    table_tensor = torch.zeros(len(lengths), max(len(t) for t in tables), dtype=torch.int32)
    for i, table in enumerate(tables):
        table_tensor[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long), block_tables=table_tensor,
        token_seq=torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)], dtype=torch.int32),
        token_pos=torch.tensor([n - 1 for n in lengths for _ in range(n)], dtype=torch.int32),
        seq_lens=list(lengths), seq_token_counts=list(lengths))


def fresh_caches(model, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(torch.zeros(NUM_BLOCKS, BLOCK, spec.num_kv_heads, spec.head_dim, dtype=dtype) for _ in range(2))
            for spec in model.cache_specs()]


def run_rows(model, seqs: list[list[int]], seed: int, dtype: torch.dtype, rows: torch.Tensor | None = None):
    """`rows` (default: every row) of `seqs`, run in one forward over a fresh paged cache."""
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    lengths = [len(s) for s in seqs]
    meta = bidirectional_metadata(lengths, block_tables(lengths, seed))
    rows = torch.arange(len(ids)) if rows is None else rows
    return model.hidden_states(ids, positions, fresh_caches(model, dtype), meta, rows)


def random_sequences(lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]  # no pad / special ids


def hf_rows(encoder, seqs: list[list[int]]) -> torch.Tensor:
    """transformers' last_hidden_state of each sequence run alone, rows end to end."""
    with torch.no_grad():
        return torch.cat([encoder(input_ids=torch.tensor([s])).last_hidden_state[0] for s in seqs])


def assert_rows_match_and_stand_alone(model, seqs: list[list[int]], want: torch.Tensor, dtype: torch.dtype,
                                      atol: float) -> None:
    """All rows in one forward within atol of `want`; each sequence alone, and the batch reversed, bitwise the same."""
    batched = run_rows(model, seqs, 0, dtype)
    assert batched.dtype == dtype and batched.shape == want.shape
    torch.testing.assert_close(batched, want, atol=atol, rtol=atol)
    lengths = [len(s) for s in seqs]
    for i, (seq, rows) in enumerate(zip(seqs, batched.split(lengths))):
        assert torch.equal(run_rows(model, [seq], i + 1, dtype), rows)
    assert torch.equal(run_rows(model, seqs[::-1], 9, dtype), torch.cat(batched.split(lengths)[::-1]))
