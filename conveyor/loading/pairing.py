"""Whether a draft model can propose tokens for a target: the same token ids for the same text."""

from __future__ import annotations

from conveyor.loading.checkpoint import Checkpoint, LoadError


def check_draft_pairing(target: Checkpoint, draft: Checkpoint) -> None:
    """Raise LoadError (one line, for the user) unless the draft shares the target's tokenizer and vocabulary."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise LoadError(f"draft model {draft.name} has a {draft.config.vocab_size}-token vocabulary but the target "
                        f"{target.name} has {target.config.vocab_size}: a draft must share the target's tokenizer")
    target_vocab = target.tokenizer.backend.get_vocab(with_added_tokens=True)
    draft_vocab = draft.tokenizer.backend.get_vocab(with_added_tokens=True)
    if target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda kv: kv[1])[:3]
        example = ", ".join(f"{token!r}={token_id}" for token, token_id in differing)
        raise LoadError(f"draft model {draft.name} does not share the tokenizer of {target.name} "
                        f"(e.g. {example}): its token ids would mean different text")
