"""The tokenizer the engine and server use: a `tokenizers` backend plus the chat template."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import tokenizers
from tokenizers import processors

from conveyor.loading.chat_template import render_chat

# Named special tokens a chat template may refer to, as in transformers' `special_tokens_map`.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# End-of-turn markers that stop generation when the chat template writes them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|return|>")
# GPT-OSS's harmony: a reply ends with <|return|> (final answer) or <|call|> (a tool call); its <|end|> only closes one
# message (the analysis before the answer), so it must not stop the reply (llama.cpp drops it from its EOG list too).
HARMONY_END_TOKENS = ("<|return|>", "<|call|>")


@dataclass
class Tokenizer:
    backend: tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_ids: list[int]  # every id that ends generation
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # e.g. {"bos_token": "<s>"}, for the template

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # NOTE: encode_batch, not encode: the same ids at the same cost, but it lets go of the GIL (tokenizers'
        # encode holds it throughout). A long prompt tokenized on the server thread otherwise starves the
        # engine's step loop and the disk-tier readers: a restart's 90 MiB prefix read took 6.5 s instead of
        # 50 ms beside a tokenizing thread (benchmarks/results.md, issue #27).
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise IndexError(f"token id {token_id} is outside the vocabulary ({self.vocab_size})")
        return piece

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list | None = None, **kwargs: Any) -> str:
        """The prompt text for `messages`; ValueError when there is no template or the template rejects them."""
        if self.chat_template is None:
            # NOTE: no ChatML fallback on purpose: a guessed format makes a base model answer worse, silently.
            raise ValueError("this model has no chat template; use plain text completion instead")
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        variables = {**self.special_tokens, "documents": None, **kwargs}
        return render_chat(self.chat_template, messages, tools=tools,
                           add_generation_prompt=add_generation_prompt, **variables)


def build_tokenizer(backend: tokenizers.Tokenizer, special_tokens: dict[str, str | None], chat_template: str | None,
                    extra_eos_ids: Sequence[int] = (), add_bos: bool | None = None,
                    add_eos: bool | None = None) -> Tokenizer:
    """Wrap `backend`; explicit add_bos/add_eos flags rewrite its post-processor, as transformers does."""
    known = {k: v for k, v in special_tokens.items() if v is not None and backend.token_to_id(v) is not None}
    bos, eos = known.get("bos_token"), known.get("eos_token")
    if add_bos is not None or add_eos is not None or backend.post_processor is None:
        _set_post_processor(backend, bos if add_bos else None, eos if add_eos else None)
    eos_ids = [backend.token_to_id(eos)] if eos is not None else []
    eos_ids += list(extra_eos_ids)
    harmony = bool(chat_template) and all(t in chat_template for t in HARMONY_END_TOKENS)  # type: ignore[operator]
    ends = HARMONY_END_TOKENS if harmony else END_OF_TURN_TOKENS
    eos_ids += [backend.token_to_id(t) for t in ends if chat_template and t in chat_template]
    if harmony:  # whatever the metadata named (<|end|> as EOS in some conversions)
        eos_ids = [i for i in eos_ids if i != backend.token_to_id("<|end|>")]
    return Tokenizer(
        backend=backend,
        bos_token_id=backend.token_to_id(bos) if bos is not None else None,
        eos_token_ids=list(dict.fromkeys(i for i in eos_ids if i is not None)),
        chat_template=chat_template,
        special_tokens=known,
    )


def _set_post_processor(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> None:
    """transformers' update_post_processor: `[bos] $A [eos]` for one sequence, the same again for a pair."""
    single = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []))
    pair = " ".join([single] + ([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else []))
    specials = [(t, backend.token_to_id(t)) for t in (bos, eos) if t]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
