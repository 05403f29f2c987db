"""Tiny pooling checkpoints for tests, written as the Hub ships them (transformers is the test oracle, so
these live beside the tests, not in conveyor.testing)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conveyor.testing import smollm_tokenizer


def write_qwen3_embedder(path, pooling: str = "lasttoken", normalize: bool = True, dense: bool = False) -> str:
    """A tiny random Qwen3 saved as transformers' Qwen3Model (no head, no `model.` prefix, as Qwen3-Embedding
    ships), with sentence-transformers' modules.json, pooling config and prompts."""
    transformers = pytest.importorskip("transformers")
    tokenizer = smollm_tokenizer()
    config = transformers.Qwen3Config(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=512, tie_word_embeddings=True)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Qwen3Model(config)
    with torch.no_grad():  # random weights large enough that texts differ visibly
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.save_pretrained(path)
    tokenizer.backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<|endoftext|>",
                   "eos_token": "<|endoftext|>", "model_max_length": 512}, f)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    os.makedirs(os.path.join(path, "1_Pooling"))
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, f"pooling_mode_{pooling}": True}, f)
    if dense:
        from safetensors.torch import save_file

        os.makedirs(os.path.join(path, "2_Dense"))
        with open(os.path.join(path, "2_Dense", "config.json"), "w") as f:
            json.dump({"in_features": 64, "out_features": 32, "bias": True,
                       "activation_function": "torch.nn.modules.activation.Tanh"}, f)
        gen = torch.Generator().manual_seed(1)
        save_file({"linear.weight": torch.randn(32, 64, generator=gen) * 0.2,
                   "linear.bias": torch.randn(32, generator=gen) * 0.2},
                  os.path.join(path, "2_Dense", "model.safetensors"))
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    if normalize:
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    with open(os.path.join(path, "config_sentence_transformers.json"), "w") as f:
        json.dump({"prompts": {"query": "Instruct: find the passage\nQuery:", "document": ""},
                   "default_prompt_name": None, "similarity_fn_name": "cosine"}, f)
    return str(path)


def write_qwen3_reranker(path) -> str:
    """A tiny random Qwen3ForCausalLM as Qwen3-Reranker ships (a causal LM read by its "yes" / "no" logits)."""
    transformers = pytest.importorskip("transformers")
    tokenizer = smollm_tokenizer()
    config = transformers.Qwen3Config(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(1)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.save_pretrained(path)
    tokenizer.backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}, f)
    return str(path)


def wordpiece_tokenizer_json(path, specials: dict[str, str], pair_template: str, single_template: str) -> None:
    """A tiny lowercase WordPiece tokenizer (letters, digits, punctuation, their ## continuations) saved as
    tokenizer.json, with the post-processor BERT (or XLM-R) uses to wrap one text or a pair."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, normalizers, pre_tokenizers, processors

    pieces = [c for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-:;"]
    words = ["the", "of", "and", "to", "is", "capital", "france", "paris", "fox", "dog", "text", "vector"]
    vocab_list = list(specials.values()) + pieces + [f"##{c}" for c in pieces] + words
    vocab = {token: i for i, token in enumerate(vocab_list)}
    tok = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token=specials["unk"]))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    ids = {name: vocab[token] for name, token in specials.items()}
    tok.post_processor = processors.TemplateProcessing(
        single=single_template, pair=pair_template,
        special_tokens=[(specials[n], ids[n]) for n in ("cls", "sep")])
    tok.save(os.path.join(path, "tokenizer.json"))
    return len(vocab_list)


BERT_SPECIALS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
XLMR_SPECIALS = {"cls": "<s>", "pad": "<pad>", "sep": "</s>", "unk": "<unk>", "mask": "<mask>"}


def write_encoder(path, kind: str = "bert", pooling: str | None = "mean_tokens", normalize: bool = True,
                  classifier: bool = False, classifier_pooling: str = "mean") -> str:
    """A tiny random BERT (all-MiniLM-style: mean pooling, normalised) or XLM-R (BGE-style: CLS) embedder as
    sentence-transformers saves it; `classifier`: a cross-encoder instead (BERT: ms-marco MiniLM's head on the
    pooler; XLM-R: bge-reranker's; ModernBERT: gte-reranker-modernbert's, pooled by `classifier_pooling`)."""
    transformers = pytest.importorskip("transformers")
    os.makedirs(path, exist_ok=True)
    if kind in ("bert", "modernbert", "nomic_bert"):
        vocab = wordpiece_tokenizer_json(path, BERT_SPECIALS, "[CLS] $A [SEP] $B:1 [SEP]:1", "[CLS] $A [SEP]")
        shape = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=128, pad_token_id=0)
        if kind == "bert":
            model = (transformers.BertForSequenceClassification(transformers.BertConfig(**shape, num_labels=1))
                     if classifier else transformers.BertModel(transformers.BertConfig(**shape), add_pooling_layer=False))
        elif kind == "modernbert":  # layers 0 and 3 global, 1 and 2 local (+-4): texts longer than the window
            config = transformers.ModernBertConfig(
                **{**shape, "num_hidden_layers": 4}, local_attention=8, global_attn_every_n_layers=3,
                cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3,
                **(dict(num_labels=1, classifier_pooling=classifier_pooling) if classifier else {}))
            model = (transformers.ModernBertForSequenceClassification(config) if classifier
                     else transformers.ModernBertModel(config))
        else:
            model = transformers.NomicBertModel(transformers.NomicBertConfig(**shape))
        specials = BERT_SPECIALS
    else:
        vocab = wordpiece_tokenizer_json(path, XLMR_SPECIALS, "<s> $A </s> </s> $B </s>", "<s> $A </s>")
        config = transformers.XLMRobertaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, intermediate_size=128,
                                               max_position_embeddings=130, pad_token_id=1, bos_token_id=0,
                                               eos_token_id=2, type_vocab_size=1, num_labels=1)
        model = (transformers.XLMRobertaForSequenceClassification(config) if classifier
                 else transformers.XLMRobertaModel(config, add_pooling_layer=False))
        specials = XLMR_SPECIALS
    torch.manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name.lower():
                param.normal_(0, 0.2)
    model.save_pretrained(path)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 128,
                   **{f"{name}_token": token for name, token in specials.items()}}, f)
    if classifier or pooling is None:
        return str(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, f"pooling_mode_{pooling}": True}, f)
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    return str(path)


# EmbeddingGemma's named prompts (config_sentence_transformers.json of google/embeddinggemma-300m, a few of them).
EMBEDDINGGEMMA_PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: ",
                          "Classification": "task: classification | query: ",
                          "STS": "task: sentence similarity | query: "}


def write_embeddinggemma(path, sliding_window: int = 8) -> str:
    """A tiny random EmbeddingGemma as sentence-transformers saves google/embeddinggemma-300m: transformers'
    Gemma3TextModel with use_bidirectional_attention (no head, no `model.` prefix), mean pooling, two Dense layers
    without bias (hidden -> 2 x hidden -> hidden, Identity), Normalize, and its prompts. Six layers, the last global
    (Gemma 3's pattern, which llama.cpp assumes); config.json keeps `sliding_window` as written (the whole window:
    transformers reads +-sliding_window // 2 from it), so texts of a dozen tokens reach past it."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    tokenizer = smollm_tokenizer()
    config = transformers.Gemma3TextConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=512, sliding_window=sliding_window, use_bidirectional_attention=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    config.architectures = ["Gemma3TextModel"]
    torch.manual_seed(0)
    model = transformers.Gemma3TextModel(config)
    with torch.no_grad():  # random weights (norms too) large enough that texts differ visibly
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:  # (transformers rewrites an odd window as even)
        json.dump({**raw, "sliding_window": sliding_window}, f, indent=2)
    tokenizer.backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<|endoftext|>",
                   "eos_token": "<|endoftext|>", "model_max_length": 512}, f)
    with open(os.path.join(path, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 512, "do_lower_case": False}, f)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
               {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
               {"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"}]
    os.makedirs(os.path.join(path, "1_Pooling"))
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
                   "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
                   "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False,
                   "include_prompt": True}, f)
    gen = torch.Generator().manual_seed(1)
    for folder, (inputs, outputs) in (("2_Dense", (64, 128)), ("3_Dense", (128, 64))):
        os.makedirs(os.path.join(path, folder))
        with open(os.path.join(path, folder, "config.json"), "w") as f:
            json.dump({"in_features": inputs, "out_features": outputs, "bias": False,
                       "activation_function": "torch.nn.modules.linear.Identity"}, f)
        save_file({"linear.weight": torch.randn(outputs, inputs, generator=gen) * 0.2},
                  os.path.join(path, folder, "model.safetensors"))
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    with open(os.path.join(path, "config_sentence_transformers.json"), "w") as f:
        json.dump({"prompts": EMBEDDINGGEMMA_PROMPTS, "default_prompt_name": None, "similarity_fn_name": "cosine"}, f)
    return str(path)
