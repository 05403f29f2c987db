"""NomicBERT (arch `nomic-bert`, a `bert` WordPiece vocabulary) and ModernBERT (arch `modern-bert`, a `gpt2` byte-level
BPE one) GGUF files as llama.cpp's converter writes them: loaded, their config is the source directory's, they
tokenize as its tokenizer.json and embed as the directory does."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import tokenizers
import torch
from tiny_checkpoints import write_modernbert_gguf, write_nomic_bert_gguf

from conveyor.engine.llm import LLM
from conveyor.loading import LoadError, load_checkpoint
from tests.pooling_models import BERT_SPECIALS, write_encoder

transformers = pytest.importorskip("transformers")

F32, F16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16
# punctuation, upper case, accents, CJK, characters the vocabularies lack, a literal special token, runs of spaces;
# the longer ones past ModernBERT's local window (+-4 here)
TEXTS = ["Hello, World!", "the capital of France is Paris.", "UPPER case; with-dashes: ok?", "naïve café ☃ 東京",
         "unknown ∰ chars 🦙 and [MASK]", "  spaced   out\tand\nnewlines  ", "a", ""]
# What both loaders must agree on (the rest are defaults both leave alone).
CONFIG_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "bidirectional",
                 "attention_bias", "attention_out_bias", "mlp_bias", "tie_word_embeddings", "rope_theta",
                 "local_rope_theta", "rope_scaling", "sliding_window", "layer_types", "max_position_embeddings",
                 "type_vocab_size", "layer_norm_eps")


def _nomic_dir(path) -> str:
    """write_encoder's NomicBERT (mean pooled, normalised) with BERT's special tokens registered as added tokens."""
    write_encoder(path, "nomic_bert")
    backend = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    backend.add_special_tokens(list(BERT_SPECIALS.values()))
    backend.save(os.path.join(path, "tokenizer.json"))
    return str(path)


# A byte-level BPE as ModernBERT's (GPT-2's bytes, no prefix space): merges for a few words, the specials last.
_MERGES = [("t", "h"), ("th", "e"), ("Ġ", "the"), ("i", "s"), ("Ġ", "is"), ("o", "f"), ("Ġ", "of"), ("a", "n"),
           ("an", "d"), ("Ġ", "c"), ("Ġc", "a"), ("Ġca", "p")]
_SPECIALS = {"unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "pad": "[PAD]", "mask": "[MASK]"}


def _modernbert_dir(path) -> str:
    """A tiny random ModernBERT embedder (4 layers: 0 and 3 global, 1 and 2 local over +-4; mean pooled, normalised)
    with ModernBERT's kind of tokenizer: byte-level BPE, each text as [CLS] text [SEP]."""
    os.makedirs(path, exist_ok=True)
    tokens = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in _MERGES]
    tokens += list(_SPECIALS.values())
    ids = {token: i for i, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(ids, _MERGES))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    backend.add_special_tokens(list(_SPECIALS.values()))
    backend.save(os.path.join(path, "tokenizer.json"))
    config = transformers.ModernBertConfig(
        vocab_size=len(tokens), hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=128, local_attention=8, global_attn_every_n_layers=3, pad_token_id=ids["[PAD]"],
        cls_token_id=ids["[CLS]"], sep_token_id=ids["[SEP]"], bos_token_id=ids["[CLS]"], eos_token_id=ids["[SEP]"])
    torch.manual_seed(3)
    model = transformers.ModernBertModel(config)
    with torch.no_grad():  # norms off 1 and weights large enough that a misplaced tensor shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            else:
                param.normal_(0, 0.2)
    model.save_pretrained(path)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 128,
                   **{f"{name}_token": token for name, token in _SPECIALS.items()}}, f)
    os.makedirs(os.path.join(path, "1_Pooling"))
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}, f)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    return str(path)


WRITERS = {"nomic_bert": (_nomic_dir, write_nomic_bert_gguf), "modernbert": (_modernbert_dir, write_modernbert_gguf)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("encoder_dirs")
    return {kind: write_dir(root / kind) for kind, (write_dir, _) in WRITERS.items()}


@pytest.fixture(scope="module")
def ggufs(dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("encoder_ggufs")
    return {kind: WRITERS[kind][1](root / f"{kind}.gguf", path) for kind, path in dirs.items()}


@pytest.mark.parametrize("kind", WRITERS)
def test_config_and_pooling_match_the_hf_directory(ggufs, dirs, kind):
    ours, theirs = load_checkpoint(ggufs[kind]), load_checkpoint(dirs[kind])
    assert ours.config.architecture == kind
    for name in CONFIG_FIELDS:
        assert getattr(ours.config, name) == getattr(theirs.config, name), name
    assert ours.pooling == theirs.pooling and ours.pooling.pooling == "mean"


@pytest.mark.parametrize("kind", WRITERS)
def test_token_ids_match_tokenizer_json(ggufs, dirs, kind):
    ours = load_checkpoint(ggufs[kind]).tokenizer
    theirs = tokenizers.Tokenizer.from_file(os.path.join(dirs[kind], "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text).ids, text
    assert "capital" in ours.decode(ours.encode("the capital"))


@pytest.mark.parametrize("kind", WRITERS)
def test_vectors_match_the_hf_directory(ggufs, dirs, kind):
    llm = LLM(model=ggufs[kind], dtype="float32")
    assert llm.engine.pooling_task == "embedding"
    ours = torch.tensor(llm.embed(TEXTS))
    theirs = torch.tensor(LLM(model=dirs[kind], dtype="float32").embed(TEXTS))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", WRITERS)
def test_f16_matrices_stay_f16_and_embed_alike(dirs, tmp_path, kind):
    path = WRITERS[kind][1](tmp_path / f"{kind}.gguf", dirs[kind], F16)
    weights = load_checkpoint(path).weights
    matrices = [name for name, w in weights.items() if w.dim() == 2 and "token_type" not in name]  # types: F32
    assert matrices and all(weights[name].dtype == torch.float16 for name in matrices)
    ours = torch.tensor(LLM(model=path, dtype="float32").embed(TEXTS[:4]))
    theirs = torch.tensor(LLM(model=dirs[kind], dtype="float32").embed(TEXTS[:4]))
    assert torch.nn.functional.cosine_similarity(ours, theirs).min() > 0.999


def test_modernbert_classifier_head_is_refused(dirs, tmp_path):
    """ModernBertForSequenceClassification's head (cls, cls.norm, cls.output) is not run: refused, not dropped."""
    path = write_modernbert_gguf(tmp_path / "modernbert.gguf", dirs["modernbert"],
                                 extra={"cls.weight": np.zeros((64, 64), np.float32),
                                        "cls.output.weight": np.zeros((1, 64), np.float32)})
    with pytest.raises(LoadError, match="classifier head"):
        load_checkpoint(path)
