"""--draft-vocab FILE / --draft-vocab-size N: which token ids a drafter's head scores (models/draft_vocab.py).

The file ranks tokens by how often the model writes them: one `TOKEN_ID COUNT` pair per line (`#` starts a
comment), as `write_token_counts` writes it from counted outputs. The subset is the special tokens (EOS and the
tokenizer's other special tokens: a draft must be able to end a reply) and then the most frequent ids, ties by
the lower id, up to N in all (N = 0: every id the file lists). Without a file the drafter scores the whole
vocabulary. A bad file or size is a LoadError at startup, never a failure mid-request.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Iterable, Mapping

import torch
from torch import nn

from conveyor.config import EngineConfig
from conveyor.loading import Checkpoint, LoadError
from conveyor.loading.tokenizer import Tokenizer
from conveyor.models.draft_vocab import DraftVocabHead
from conveyor.models.hybrid_layout import FAMILY_NAMES
from conveyor.models.tensors import Weight
from conveyor.models.weights import WeightLoader

logger = logging.getLogger(__name__)


def read_token_counts(path: str | Path) -> dict[int, int]:
    """`TOKEN_ID COUNT` lines -> {id: count}; a LoadError naming the line for anything else."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise LoadError(f"--draft-vocab {path}: cannot read it ({exc})") from None
    counts: dict[int, int] = {}
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        try:
            token_id, count = (int(f) for f in fields)
        except ValueError:
            raise LoadError(f"--draft-vocab {path}:{number}: expected `TOKEN_ID COUNT`, got {line.strip()!r}") from None
        if token_id < 0 or count < 0:
            raise LoadError(f"--draft-vocab {path}:{number}: token id and count must be >= 0")
        counts[token_id] = counts.get(token_id, 0) + count
    if not counts:
        raise LoadError(f"--draft-vocab {path}: no `TOKEN_ID COUNT` lines")
    return counts


def write_token_counts(path: str | Path, token_lists: Iterable[Iterable[int]]) -> Counter:
    """Count the tokens of `token_lists` (a model's outputs) into a --draft-vocab file, most frequent first."""
    counts = Counter(t for tokens in token_lists for t in tokens)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    Path(path).write_text("".join(f"{t} {c}\n" for t, c in ranked), encoding="utf-8")
    return counts


def count_text_files(tokenizer: Tokenizer, paths: Iterable[str | Path]) -> Iterable[list[int]]:
    """Each text file's token ids (no special tokens added): a corpus like the text the server will write."""
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise LoadError(f"draft-vocab: cannot read {path} ({exc})") from None
        yield tokenizer.encode(text, add_special_tokens=False)


def coverage(counts: Counter, sizes: Iterable[int]) -> dict[int, float]:
    """The share of the counted tokens the top N ids hold, per N below the number of distinct ids."""
    ranked = sorted(counts.values(), reverse=True)
    total = sum(ranked) or 1
    return {n: round(sum(ranked[:n]) / total, 4) for n in sizes if n < len(ranked)}


def special_token_ids(tokenizer: Tokenizer) -> set[int]:
    """EOS ids, BOS and every added token the tokenizer marks special."""
    ids = set(tokenizer.eos_token_ids)
    if tokenizer.bos_token_id is not None:
        ids.add(tokenizer.bos_token_id)
    ids.update(i for i, token in tokenizer.backend.get_added_tokens_decoder().items() if token.special)
    return ids


def select_token_ids(counts: Mapping[int, int], size: int, vocab_size: int, keep: Iterable[int]) -> torch.Tensor:
    """Ascending ids (N,): `keep` (within the vocabulary), then the most frequent of `counts` up to `size` in all
    (0: all of them). A LoadError when an id is past the vocabulary or `size` leaves no room past `keep`."""
    outside = sorted(t for t in counts if t >= vocab_size)
    if outside:
        raise LoadError(f"--draft-vocab: token id {outside[0]} is outside the model's vocabulary ({vocab_size}); "
                        "was the file counted with another model's tokenizer?")
    if size > vocab_size:
        raise LoadError(f"--draft-vocab-size {size} is larger than the model's vocabulary ({vocab_size})")
    chosen = {t for t in keep if 0 <= t < vocab_size}
    if size and size <= len(chosen):
        raise LoadError(f"--draft-vocab-size {size} leaves no room: the {len(chosen)} special tokens are always kept")
    for token_id in sorted(counts, key=lambda t: (-counts[t], t)):
        if size and len(chosen) >= size:
            break
        chosen.add(token_id)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def head_weight(target: Checkpoint) -> Weight:
    """The checkpoint tensor the target's lm_head was loaded from (its own, or the tied embedding)."""
    weights, cfg = target.weights, target.config
    if not cfg.tie_word_embeddings and "lm_head.weight" in weights:
        return weights["lm_head.weight"]
    name = FAMILY_NAMES.get(cfg.architecture, {}).get("embed", "model.embed_tokens.weight")
    if name not in weights:
        raise LoadError(f"--draft-vocab: cannot find {target.name}'s LM head weight (lm_head.weight or {name})")
    return weights[name]


def attach_draft_vocab(config: EngineConfig, target: Checkpoint, head: nn.Module, loader: WeightLoader) -> str:
    """head.draft_vocab from --draft-vocab (a DraftVocabHead over the target's head rows), or None without the
    flag; the suffix the drafter's name gets (the adaptive policy's verdicts differ per subset)."""
    if config.draft_vocab is None:
        head.draft_vocab = None
        return ""
    cfg = target.config
    token_ids = select_token_ids(read_token_counts(config.draft_vocab), config.draft_vocab_size, cfg.vocab_size,
                                 special_token_ids(target.tokenizer))
    vocab = DraftVocabHead(token_ids, cfg.hidden_size, loader.ops)
    vocab.load(head_weight(target), loader, config.draft_vocab_type)
    head.draft_vocab = vocab
    logger.info("draft vocabulary: %d of %d token ids from %s (rows: %s)", len(token_ids), cfg.vocab_size,
                config.draft_vocab, config.draft_vocab_type)
    return f":vocab{len(token_ids)}" + ("" if config.draft_vocab_type == "same" else f":{config.draft_vocab_type}")
