"""Build the tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata."""

from __future__ import annotations

import logging
from functools import lru_cache

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from conveyor.loading.checkpoint import LoadError
from conveyor.loading.gguf_config import field_value
from conveyor.loading.tokenizer import Tokenizer, build_tokenizer
from conveyor.models import family as families

logger = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
PHANTOM_SPACE = "\u2581"  # the `bert` vocabulary's mark of a word start

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5: Qwen2's split with combining marks (\p{M}) kept inside words.
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-OSS's o200k (llama.cpp's "gpt-4o"): cased words keep their contraction, digits in threes.
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# `tokenizer.ggml.pre` names whose split differs from GPT-2's; the rest use ByteLevel's built-in GPT-2 regex.
PRE_TOKENIZER_SPLITS = {
    "gpt-4o": _GPT4O_SPLIT,
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "lfm2": _LLAMA3_SPLIT, "qwen35": _QWEN35_SPLIT,
}
# `tokenizer.ggml.pre` names for which llama.cpp adds BOS when the file does not say (besides SentencePiece).
ADD_BOS_PRE = ("lfm2",)


def tokenizer_from_gguf(reader: gguf.GGUFReader, source: str) -> Tokenizer:
    kind = field_value(reader, "tokenizer.ggml.model")
    tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens") or []
    if not tokens:
        raise LoadError(f"{source}: GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    token_types = field_value(reader, "tokenizer.ggml.token_type") or []
    if kind in ENCODER_TOKENIZERS:
        return _encoder_tokenizer(reader, kind, tokens, token_types, source)
    if kind == "gpt2":
        backend = _byte_level_bpe(reader, tokens)
    elif kind == "llama":
        backend = _sentencepiece_bpe(reader, tokens)
    elif kind == "gemma4":
        backend = _sentencepiece_bpe(reader, tokens, newline_runs=True)
    else:
        raise LoadError(f"{source}: unsupported GGUF tokenizer {kind!r}; supported: gpt2 (byte-level BPE), llama "
                        "(SentencePiece), gemma4 (SentencePiece-style BPE), bert (WordPiece), t5 (Unigram)")
    _add_special_tokens(backend, tokens, token_types, byte_level=kind == "gpt2")

    def token(key: str) -> str | None:
        index = field_value(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    special = {"bos_token": token("bos"), "eos_token": token("eos"), "unk_token": token("unknown"),
               "pad_token": token("padding")}
    extra_eos = [field_value(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eot", "eom")]
    # llama.cpp adds BOS for SentencePiece vocabularies (and a few pre-tokenizers) unless the file says otherwise.
    default_bos = kind == "llama" or field_value(reader, "tokenizer.ggml.pre") in ADD_BOS_PRE
    add_bos = bool(field_value(reader, "tokenizer.ggml.add_bos_token", default_bos))
    add_eos = bool(field_value(reader, "tokenizer.ggml.add_eos_token", False))
    template = field_value(reader, "tokenizer.chat_template")
    arch = field_value(reader, "general.architecture")
    family = families.for_gguf(arch) if template is None else None
    if family is not None and family.chat_template is not None:  # its one chat format, so not a guess
        logger.info("%s: no chat template in the file; using the %s family's", source, arch)
        template = family.chat_template
    return build_tokenizer(backend, special, template,
                           extra_eos_ids=[i for i in extra_eos if i is not None], add_bos=add_bos, add_eos=add_eos)


# The encoders' vocabularies: `tokenizer.ggml.model` -> the keys of the ids a text is wrapped in (CLS, SEP) with
# llama.cpp's defaults where the file names none (llama-vocab.cpp: WPM wraps in bos and sep; UGM in bos and eos).
ENCODER_TOKENIZERS = {"bert": (("bos", 101), ("seperator", 102)), "t5": (("bos", None), ("eos", None))}


def _encoder_tokenizer(reader: gguf.GGUFReader, kind: str, tokens: list[str], token_types: list[int],
                       source: str) -> Tokenizer:
    """An encoder's tokenizer: each text wrapped as `cls a sep` by its post-processor, whatever the add_* flags."""
    def token_id(key: str, default: int | None = None) -> int | None:
        index = field_value(reader, f"tokenizer.ggml.{key}_token_id", default)
        return index if index is not None and 0 <= index < len(tokens) else None

    (cls_key, cls_default), (sep_key, sep_default) = ENCODER_TOKENIZERS[kind]
    cls, sep = token_id(cls_key, cls_default), token_id(sep_key, sep_default)
    unk = token_id("unknown", 100 if kind == "bert" else None)
    if cls is None or sep is None:
        raise LoadError(f"{source}: the {kind} vocabulary names no {cls_key} and {sep_key} tokens to wrap texts in")
    if kind == "bert":
        tokens = _wordpiece_spelling(tokens, token_types)
        backend = _wordpiece(reader, tokens, tokens[unk] if unk is not None else "[UNK]")
        # transformers' BERT template: the second text (a reranker's document) has token type 1
        pair = f"{tokens[cls]}:0 $A:0 {tokens[sep]}:0 $B:1 {tokens[sep]}:1"
    else:
        backend = _unigram(reader, tokens, unk)
        pair = f"{tokens[cls]} $A {tokens[sep]} {tokens[sep]} $B {tokens[sep]}"  # XLM-R's RobertaProcessing
    backend.post_processor = processors.TemplateProcessing(
        single=f"{tokens[cls]} $A {tokens[sep]}", pair=pair, special_tokens=[(tokens[cls], cls), (tokens[sep], sep)])
    _add_special_tokens(backend, tokens, token_types, byte_level=False)

    def token(index: int | None) -> str | None:
        return tokens[index] if index is not None else None

    special = {"bos_token": token(cls), "eos_token": token(sep), "cls_token": token(cls), "sep_token": token(sep),
               "unk_token": token(unk), "pad_token": token(token_id("padding")), "mask_token": token(token_id("mask"))}
    return build_tokenizer(backend, special, None)


def _wordpiece_spelling(tokens: list[str], token_types: list[int]) -> list[str]:
    """Undo convert_hf_to_gguf's phantom-space spelling of a WordPiece vocabulary: it wrote word starts as
    "\u2581word" and continuations "##ing" as "ing" (control tokens as they were)."""
    def spelled(token: str, kind: int) -> str:
        if kind == CONTROL:
            return token
        return token[1:] if token.startswith(PHANTOM_SPACE) else "##" + token

    return [spelled(token, kind) for token, kind in zip(tokens, token_types or [0] * len(tokens))]


def _wordpiece(reader: gguf.GGUFReader, tokens: list[str], unk: str) -> tokenizers.Tokenizer:
    """llama.cpp's `bert` (WPM) tokenizer as transformers' BertTokenizerFast: BertNormalizer (lowercase and
    strip_accents as the file says, both on by default as in llama.cpp), whitespace, punctuation and CJK splits,
    then the longest known piece first."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    backend = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token=unk))
    lowercase = bool(field_value(reader, "tokenizer.ggml.normalizer.lowercase", True))
    strip_accents = bool(field_value(reader, "tokenizer.ggml.normalizer.strip_accents", lowercase))
    backend.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                    strip_accents=strip_accents, lowercase=lowercase)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    return backend


def _unigram(reader: gguf.GGUFReader, tokens: list[str], unk: int | None) -> tokenizers.Tokenizer:
    """llama.cpp's `t5` (UGM) vocabulary, as XLM-RoBERTa's is converted, like transformers' XLMRobertaTokenizerFast:
    SentencePiece's precompiled normalizer, whitespace runs dropped (remove_extra_whitespaces), Metaspace, then
    Unigram by the file's scores."""
    scores = field_value(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    backend = tokenizers.Tokenizer(models.Unigram([(t, float(s)) for t, s in zip(tokens, scores)], unk_id=unk,
                                                  byte_fallback=False))
    charsmap = field_value(reader, "tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        backend.normalizer = normalizers.Precompiled(bytes(int(b) & 0xFF for b in charsmap))
    scheme = "always" if field_value(reader, "tokenizer.ggml.add_space_prefix", True) else "never"
    metaspace = pre_tokenizers.Metaspace(replacement=PHANTOM_SPACE, prepend_scheme=scheme)
    backend.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), metaspace])
                             if field_value(reader, "tokenizer.ggml.remove_extra_whitespaces", True) else metaspace)
    backend.decoder = decoders.Metaspace(replacement=PHANTOM_SPACE, prepend_scheme=scheme)
    return backend


def _byte_level_bpe(reader: gguf.GGUFReader, tokens: list[str]) -> tokenizers.Tokenizer:
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    # Some converters store tokens as raw text; the BPE model needs them spelled in the byte alphabet.
    vocab = {}
    for index, token in enumerate(tokens):
        spelled = token if letters.issuperset(token) else "".join(alphabet[b] for b in token.encode())
        vocab[spelled] = index
    merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges") or []]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = field_value(reader, "tokenizer.ggml.pre")
    if pre == "smollm":
        # llama.cpp's smollm split: every digit alone, then GPT-2's regex (as in SmolLM2's tokenizer.json).
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in PRE_TOKENIZER_SPLITS:
        split = pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated")
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(reader: gguf.GGUFReader, tokens: list[str], newline_runs: bool = False) -> tokenizers.Tokenizer:
    """SentencePiece BPE as transformers' LlamaTokenizer builds it: Metaspace, byte fallback.

    `newline_runs` (llama.cpp's `gemma4` tokenizer): runs of newlines are split from the text around them, and a run
    that is a token of its own is taken whole (llama.cpp's gemma4 pre-tokenizer and its newline fix)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = field_value(reader, "tokenizer.ggml.merges")
    if merges:
        # llama.cpp splits at the first space after the first character
        pairs = [(m[:m.index(" ", 1)], m[m.index(" ", 1) + 1:]) for m in merges]
    else:
        pairs = _merges_from_scores(vocab, field_value(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens))
    # gemma4: a newline run that is a token is taken whole (ignore_merges; the other pieces are BPE's own tokens)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True,
                                              ignore_merges=newline_runs))
    prefix = bool(field_value(reader, "tokenizer.ggml.add_space_prefix", True))
    metaspace = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first" if prefix else "never",
                                         split=False)
    backend.pre_tokenizer = metaspace
    if newline_runs:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("\n+"), "isolated"), metaspace])
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two known tokens, best-scored merged token first (transformers' generate_merges)."""
    merges = []
    for token, score in zip(vocab, scores):
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges += [(left, right, score) for left, right in pairs]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: list[str], token_types: list[int],
                        byte_level: bool) -> None:
    # Control tokens (<|im_start|>) and user-defined ones (<think>) must match whole in text, never split.
    letters = set(_byte_alphabet().values())
    # In a byte-level vocabulary a control token outside the byte alphabet is a converter mislabel.
    control = [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, token_types)
               if kind == CONTROL and (not byte_level or letters.issuperset(t))]
    backend.add_special_tokens(control)
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(tokens, token_types) if kind == USER_DEFINED])


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(c) for byte, c in zip(printable, chars)}
