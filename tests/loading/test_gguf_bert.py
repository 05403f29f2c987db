"""BERT and XLM-RoBERTa GGUF files as llama.cpp's converter writes them (arch `bert`, a `bert` WordPiece or `t5`
Unigram vocabulary): loaded, they tokenize as the source directory's tokenizer.json and embed (or score) as the
directory does; a BERT cross-encoder, whose pooler the converter drops, scores as llama.cpp scores it."""

from __future__ import annotations

import json
import logging
import os

import gguf
import numpy as np
import pytest
import tokenizers
import torch
from safetensors.torch import load_file
from tiny_checkpoints import write_encoder_gguf

from conveyor.engine.llm import LLM
from conveyor.loading import LoadError, load_checkpoint
from conveyor.loading.checkpoint import QuantizedTensor
from conveyor.models.weights import weight_bytes_by_format
from tests.pooling_models import BERT_SPECIALS, XLMR_SPECIALS, write_encoder

Q8_0, F16 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16
# punctuation, upper case, accents, CJK, characters the vocabulary lacks, a literal special token, runs of spaces
TEXTS = ["Hello, World!", "the capital of France is Paris.", "UPPER case; with-dashes: ok?", "naïve café ☃ 東京",
         "unknown ∰ chars 🦙 and [MASK] <mask>", "  spaced   out\tand\nnewlines  ", "a", ""]
PAIRS = [("the capital of france", "Paris is the capital."), ("a dog", "THE quick fox!")]


def _bert_dir(path, classifier: bool = False) -> str:
    """write_encoder's BERT (an embedder, or an ms-marco-style cross-encoder) with its special tokens registered as
    added tokens, as BERT's tokenizer.json has them."""
    write_encoder(path, "bert", classifier=classifier)
    backend = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    backend.add_special_tokens(list(BERT_SPECIALS.values()))
    backend.save(os.path.join(path, "tokenizer.json"))
    return str(path)


def _xlmr_dir(path, classifier: bool = False) -> str:
    """write_encoder's XLM-R (a CLS-pooled embedder, or a cross-encoder) with a SentencePiece Unigram tokenizer.json
    as transformers saves XLM-R's (no precompiled normalizer: none of the texts needs one)."""
    write_encoder(path, "xlmr", pooling="cls_token", classifier=classifier)
    with open(os.path.join(path, "config.json")) as f:
        size = json.load(f)["vocab_size"]
    words = ["the", "of", "and", "to", "is", "capital", "france", "paris", "fox", "dog", "text", "vector"]
    letters, digits = "abcdefghijklmnopqrstuvwxyz", "0123456789"
    pieces = (["\u2581"] + [f"\u2581{w}" for w in words] + [f"\u2581{c}" for c in letters + digits] + list(letters)
              + list(digits + ".,!?'-:;") + ["ing", "er", "ed", "ly", "ca", "pi", "tal"])
    specials = list(XLMR_SPECIALS.values())  # <s> <pad> </s> <unk> <mask>: ids 0..4, as write_encoder numbers them
    assert len(specials) + len(pieces) == size
    vocab = [(t, 0.0) for t in specials] + [(p, -1.0 - 8.0 / len(p)) for p in pieces]  # longer pieces likelier
    unigram = tokenizers.models.Unigram(vocab, unk_id=specials.index("<unk>"), byte_fallback=False)
    backend = tokenizers.Tokenizer(unigram)
    metaspace = tokenizers.pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([tokenizers.pre_tokenizers.WhitespaceSplit(), metaspace])
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    backend.add_special_tokens(specials)
    backend.save(os.path.join(path, "tokenizer.json"))
    return str(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("encoders")
    return {"bert": _bert_dir(root / "bert"), "xlmr": _xlmr_dir(root / "xlmr"),
            "reranker": _xlmr_dir(root / "reranker", classifier=True),
            "bert_reranker": _bert_dir(root / "bert_reranker", classifier=True)}


@pytest.fixture(scope="module")
def ggufs(dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("encoder_ggufs")
    return {kind: write_encoder_gguf(root / f"{kind}.gguf", path) for kind, path in dirs.items()}


@pytest.mark.parametrize("kind,architecture,types", [("bert", "bert", 2), ("xlmr", "xlm-roberta", 1)])
def test_config_and_pooling(ggufs, dirs, kind, architecture, types):
    ours, theirs = load_checkpoint(ggufs[kind]), load_checkpoint(dirs[kind])
    config = ours.config
    assert (config.architecture, config.type_vocab_size, config.position_offset) == (architecture, types, 0)
    assert config.bidirectional and not config.tie_word_embeddings
    # XLM-R's table was cut at its padding offset: the same longest input as the directory's
    assert config.max_position_embeddings == theirs.config.max_position_embeddings == 128
    assert ours.pooling == theirs.pooling


@pytest.mark.parametrize("kind", ["bert", "xlmr"])
def test_token_ids_match_tokenizer_json(ggufs, dirs, kind):
    ours = load_checkpoint(ggufs[kind]).tokenizer
    theirs = tokenizers.Tokenizer.from_file(os.path.join(dirs[kind], "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text).ids, text
    for query, document in PAIRS:  # a reranker's input: [CLS] a [SEP] b [SEP] (XLM-R: <s> a </s></s> b </s>)
        mine, reference = ours.backend.encode(query, document), theirs.encode(query, document)
        assert (mine.ids, mine.type_ids) == (reference.ids, reference.type_ids)
    assert "unknown" in ours.decode(ours.encode("unknown text"))


@pytest.mark.parametrize("kind", ["bert", "xlmr"])
def test_vectors_match_the_hf_directory(ggufs, dirs, kind):
    llm = LLM(model=ggufs[kind], dtype="float32")
    assert llm.engine.pooling_task == "embedding"
    ours = torch.tensor(llm.embed(TEXTS))
    theirs = torch.tensor(LLM(model=dirs[kind], dtype="float32").embed(TEXTS))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_reranker_scores_match_the_hf_directory(ggufs, dirs):
    """XLM-R's classifier head (`cls`, `cls.output`) makes the file a reranker, scoring as the directory does."""
    scores = []
    for path in (ggufs["reranker"], dirs["reranker"]):
        llm = LLM(model=path, dtype="float32")
        assert llm.engine.pooling_task == "reranking"
        scores.append(llm.embed([llm.tokenizer.backend.encode(q, d).ids for q, d in PAIRS]))
    torch.testing.assert_close(torch.tensor(scores[0]), torch.tensor(scores[1]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("qtype", [Q8_0, F16])
def test_quantized_matrices_stay_quantized(dirs, tmp_path, qtype):
    path = write_encoder_gguf(tmp_path / "bert.gguf", dirs["bert"], qtype)
    weights = load_checkpoint(path).weights
    for name in ("embeddings.word_embeddings.weight", "encoder.layer.1.attention.self.query.weight",
                 "encoder.layer.0.output.dense.weight"):
        weight = weights[name]
        if qtype == Q8_0:
            assert isinstance(weight, QuantizedTensor) and weight.qtype == int(Q8_0), name
        else:
            assert weight.dtype == torch.float16, name
    assert weights["embeddings.position_embeddings.weight"].dtype == torch.float32
    # NOTE: weight_dtype q8_0, not auto: on AMX a pooling engine's auto dequantizes blocks (engine/pooling_setup.py)
    llm = LLM(model=path, dtype="bfloat16", weight_dtype="q8_0" if qtype == Q8_0 else "auto")
    if qtype == Q8_0:  # the file's blocks run as they are (bf16 activations on CPU)
        assert set(weight_bytes_by_format(llm.engine.runner.model)) == {"Q8_0", "BF16"}
    ours = torch.tensor(llm.embed(TEXTS[:4]))
    theirs = torch.tensor(LLM(model=dirs["bert"], dtype="float32").embed(TEXTS[:4]))
    assert torch.nn.functional.cosine_similarity(ours, theirs).min() > 0.99


def _bert_pair_logits(hf_dir: str, tokenizer, head: str) -> list[float]:
    """transformers' BertForSequenceClassification on each of PAIRS (the second text as token type 1): its own
    logit (`head` "pooler": classifier(tanh(pooler(first row)))), or llama.cpp's reading of the converted file
    ("no pooler": classifier(first row))."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.BertForSequenceClassification.from_pretrained(hf_dir).eval()
    logits = []
    for query, document in PAIRS:
        encoding = tokenizer.backend.encode(query, document)
        ids, types = torch.tensor([encoding.ids]), torch.tensor([encoding.type_ids])
        with torch.no_grad():
            if head == "pooler":
                logits.append(hf(input_ids=ids, token_type_ids=types).logits[0, 0].item())
            else:
                first = hf.bert(input_ids=ids, token_type_ids=types).last_hidden_state[:, 0]
                logits.append(hf.classifier(first)[0, 0].item())
    return logits


def _rerank(llm: LLM) -> torch.Tensor:
    assert llm.engine.pooling_task == "reranking"
    return torch.tensor([llm.score(query, [document])[0] for query, document in PAIRS])


def test_bert_cross_encoder_scores_as_llama_cpp(ggufs, dirs, caplog):
    """The converter drops a BERT cross-encoder's pooler and writes its `classifier` as cls.output alone: the file is
    a reranker scoring as llama.cpp does (cls.output on the first row), which is not the model's own score (said
    in a warning)."""
    with caplog.at_level(logging.WARNING, logger="conveyor.models.bert"):
        llm = LLM(model=ggufs["bert_reranker"], dtype="float32")
    assert "pooler" in caplog.text
    assert llm.engine.runner.model.config.architecture == "xlm-roberta"  # the family that keeps cls / cls.output
    ours = _rerank(llm)
    llama_cpp = torch.sigmoid(torch.tensor(_bert_pair_logits(dirs["bert_reranker"], llm.tokenizer, "no pooler")))
    torch.testing.assert_close(ours, llama_cpp, atol=1e-5, rtol=0)
    trained = _rerank(LLM(model=dirs["bert_reranker"], dtype="float32"))
    assert (ours - trained).abs().max() > 1e-3  # the pooler matters: the directory scores otherwise


def test_bert_cross_encoder_with_its_pooler_scores_as_the_hf_directory(dirs, tmp_path):
    """A BERT cross-encoder file that carries its pooler as `cls` (RoBERTa's head: tanh(cls), then cls.output, which
    is BERT's pooler then classifier) scores as the directory and transformers do."""
    hf_dir = dirs["bert_reranker"]
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    path = write_encoder_gguf(tmp_path / "bert_reranker.gguf", hf_dir,
                              extra={"cls.weight": state["bert.pooler.dense.weight"].numpy(),
                                     "cls.bias": state["bert.pooler.dense.bias"].numpy()})
    llm = LLM(model=path, dtype="float32")
    ours = _rerank(llm)
    torch.testing.assert_close(ours, _rerank(LLM(model=hf_dir, dtype="float32")), atol=1e-5, rtol=0)
    trained = torch.sigmoid(torch.tensor(_bert_pair_logits(hf_dir, llm.tokenizer, "pooler")))
    torch.testing.assert_close(ours, trained, atol=1e-5, rtol=0)


def test_a_head_of_cls_alone_is_refused(dirs, tmp_path):
    """`cls` without cls.output (a cross-encoder converted with transformers' default two labels: its `classifier`
    written as cls, its pooler dropped) is no score llama.cpp or we can read: refused."""
    path = write_encoder_gguf(tmp_path / "bert.gguf", dirs["bert"],
                              extra={"cls.weight": np.zeros((2, 64), np.float32)})
    with pytest.raises(LoadError, match="cls alone"):
        load_checkpoint(path)
