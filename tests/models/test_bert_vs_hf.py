"""The BERT encoders (models/bert.py) against transformers: every row of three sequences run in one forward
matches last_hidden_state, and each sequence's rows are bitwise those of running it alone."""

from __future__ import annotations

import pytest
import tokenizers
import torch

from conveyor.kernels import AttentionMetadata, resolve_backend
from conveyor.loading.hf_loader import load_hf_dir
from conveyor.models.bert import BertModel
from conveyor.models.config import ModelConfig, ModelConfigError
from conveyor.models.registry import build_model

transformers = pytest.importorskip("transformers")

VOCAB = 300
TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
BLOCK = 4
LENGTHS = (5, 11, 3)  # one forward: a block and a bit, three blocks less one, under a block


def _hf_model(kind: str):
    """A tiny random transformers encoder; BertForMaskedLM and XLMRobertaForSequenceClassification save
    bert./roberta.-prefixed names, as masked LMs and cross-encoders ship (neither with a pooler)."""
    if kind.startswith("bert"):
        cfg = transformers.BertConfig(**TINY, attn_implementation="eager")
        cls = {"bert_classifier": transformers.BertForSequenceClassification,
               "bert_masked_lm": transformers.BertForMaskedLM}.get(kind, transformers.BertModel)
    else:
        cfg = transformers.XLMRobertaConfig(**TINY, max_position_embeddings=40, attn_implementation="eager")
        cls = (transformers.XLMRobertaForSequenceClassification if kind == "xlmr_classifier"
               else transformers.XLMRobertaModel)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # LayerNorms start at (1, 0) and biases at 0: randomize so a skipped one cannot pass
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif "token_type" in name:
                p.add_(1.0)  # a missing type-0 row shows
    return model


def _write_dir(model, path) -> str:
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.save(str(path / "tokenizer.json"))
    return str(path)


def _metadata(lengths: list[int], tables: list[list[int]]) -> AttentionMetadata:
    """The runner's bidirectional metadata: every row of a sequence has token_pos = its length - 1."""
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for n, table in zip(lengths, tables) for p in range(n)]
    block_tables = torch.zeros(len(lengths), max(len(t) for t in tables), dtype=torch.int32)
    for i, table in enumerate(tables):
        block_tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long), block_tables=block_tables,
        token_seq=torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)], dtype=torch.int32),
        token_pos=torch.tensor([n - 1 for n in lengths for _ in range(n)], dtype=torch.int32),
        seq_lens=list(lengths), seq_token_counts=list(lengths))


def _run(model: BertModel, seqs: list[list[int]], tables: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """Every row of `seqs`, run in one forward over a fresh paged cache."""
    cfg = model.config
    caches = [(torch.zeros(16, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype),
               torch.zeros(16, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype))
              for _ in model.cache_specs()]
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    meta = _metadata([len(s) for s in seqs], tables)
    return model.hidden_states(ids, positions, caches, meta, torch.arange(len(ids)))


def _sequences() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]  # no pad / special ids


TABLES = [[5, 2], [9, 0, 7], [3]]  # scattered blocks on purpose
ALONE_TABLES = [[[1, 4]], [[6, 8, 10]], [[12]]]  # other blocks when alone


@pytest.mark.parametrize("kind", ["bert", "bert_classifier", "bert_masked_lm", "xlmr", "xlmr_classifier"])
def test_rows_match_transformers_and_alone(kind, tmp_path):
    hf = _hf_model(kind)
    checkpoint = load_hf_dir(_write_dir(hf, tmp_path))
    config = checkpoint.config
    assert config.bidirectional and config.architecture == ("bert" if kind.startswith("bert") else "xlm-roberta")
    seqs = _sequences()
    # bf16 against transformers in bf16: its own bf16 rows are ~0.3 from its fp32 ones here; ours within an ulp
    for dtype, atol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        encoder = hf.base_model.to(dtype)
        with torch.no_grad():
            want = torch.cat([encoder(input_ids=torch.tensor([s])).last_hidden_state[0] for s in seqs])
        ops = resolve_backend(torch.device("cpu"), dtype)
        model = build_model(config, checkpoint.weights, dtype, torch.device("cpu"), ops=ops)
        batched = _run(model, seqs, TABLES, dtype)
        assert batched.dtype == dtype and batched.shape == (sum(LENGTHS), config.hidden_size)
        torch.testing.assert_close(batched, want, atol=atol, rtol=atol)
        start = 0
        for seq, tables in zip(seqs, ALONE_TABLES):  # bitwise the rows of the batch
            assert torch.equal(_run(model, [seq], tables, dtype), batched[start:start + len(seq)])
            start += len(seq)
    pooler = getattr(hf.base_model, "pooler", None)  # XLMRobertaForSequenceClassification has none
    assert (model.pooler is None) == (pooler is None)  # kept where the checkpoint has one, never required
    if pooler is not None:
        assert torch.equal(model.pooler.dense_weight(), pooler.dense.weight)  # both bf16 by now


def test_rows_select_the_pooled_rows():
    """hidden_states at a few rows (CLS of each sequence) is bitwise those rows of every-row output."""
    hf = _hf_model("bert")
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    model = build_model(config, hf.state_dict(), torch.float32, torch.device("cpu"))
    seqs = _sequences()
    every = _run(model, seqs, TABLES, torch.float32)
    cfg = model.config
    caches = [(torch.zeros(16, BLOCK, cfg.num_key_value_heads, cfg.head_dim),
               torch.zeros(16, BLOCK, cfg.num_key_value_heads, cfg.head_dim)) for _ in model.cache_specs()]
    firsts = torch.tensor([0, LENGTHS[0], LENGTHS[0] + LENGTHS[1]])
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    cls_rows = model.hidden_states(ids, positions, caches, _metadata(list(LENGTHS), TABLES), firsts)
    assert torch.equal(cls_rows, every[firsts])
    with pytest.raises(NotImplementedError, match="encoder"):
        model(ids, positions, caches, _metadata(list(LENGTHS), TABLES), firsts)


def test_config_fields():
    xlmr = ModelConfig.from_hf_dict(transformers.XLMRobertaConfig(**TINY, max_position_embeddings=514).to_dict())
    assert (xlmr.position_offset, xlmr.max_position_embeddings, xlmr.type_vocab_size) == (2, 512, 2)
    assert xlmr.hidden_act == "gelu" and xlmr.layer_norm_eps == 1e-12 and xlmr.num_key_value_heads == 4
    bert = ModelConfig.from_hf_dict({**transformers.BertConfig(**TINY).to_dict(), "layer_norm_eps": 1e-7})
    assert (bert.position_offset, bert.max_position_embeddings, bert.layer_norm_eps) == (0, 512, 1e-7)
    assert bert.head_dim == 16 and bert.rotary_dim == 0
    with pytest.raises(ModelConfigError, match="relative_key"):
        ModelConfig.from_hf_dict({**transformers.BertConfig(**TINY).to_dict(),
                                  "position_embedding_type": "relative_key"})
    with pytest.raises(ModelConfigError, match="decoder"):
        ModelConfig.from_hf_dict({**transformers.BertConfig(**TINY).to_dict(), "is_decoder": True})
    with pytest.raises(ModelConfigError, match="gelu_new"):
        ModelConfig.from_hf_dict({**transformers.BertConfig(**TINY).to_dict(), "hidden_act": "gelu_new"})
    with pytest.raises(ModelConfigError, match="activation"):  # the erf GELU is the encoders' only
        ModelConfig(architecture="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=1, num_key_value_heads=1, head_dim=8, hidden_act="gelu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_rows_are_batch_invariant(dtype):
    """Past torch's threading threshold (its gelu splits the range there): each row is its bits alone."""
    gelu_erf = resolve_backend(torch.device("cpu"), dtype).gelu_erf
    x = (torch.randn(24, 3072, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    alone = torch.cat([gelu_erf(x[i:i + 1]) for i in range(len(x))])
    for rows in (5, 11, 17, 24):
        assert torch.equal(gelu_erf(x[:rows]), alone[:rows])
    torch.testing.assert_close(alone, torch.nn.functional.gelu(x.float()).to(dtype), atol=1e-5, rtol=1e-2)
