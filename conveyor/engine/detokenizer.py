"""Incremental detokenization with stop-string detection, one instance per request."""

from __future__ import annotations

from typing import Protocol, Sequence


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas.

    Decodes a short window (prefix_offset..end) and emits what extends the previously
    read text, so multi-byte characters split across tokens appear only when complete.
    Text that could still be the start of a stop string is held back from the stream.
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], stop: list[str],
                 include_stop: bool = False, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[-6:])  # a little context for merges at the seam
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""  # all output text so far (after stop truncation)
        self.emitted = 0  # chars of self.text already streamed
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.matched_stop: str | None = None  # the stop string that ended the text (Anthropic's stop_sequence)

    def add_token(self, token_id: int) -> bool:
        """Append a token; returns True when a stop string has ended the text."""
        self.token_ids.append(token_id)
        prefix_text = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset], self.skip_special)
        full_text = self.tokenizer.decode(self.token_ids[self.prefix_offset:], self.skip_special)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            new_text = full_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        else:
            return False  # incomplete character: wait for the next token
        search_from = max(0, len(self.text) - self.hold_back)
        self.text += new_text
        for stop in self.stop:
            index = self.text.find(stop, search_from)
            if index != -1:
                self.text = self.text[:index + (len(stop) if self.include_stop else 0)]
                self.matched_stop = stop
                return True
        return False

    def take_delta(self, finished: bool) -> str:
        """Text ready to stream; while unfinished, keep back a possible stop-string prefix."""
        end = len(self.text) if finished or not self.stop else max(self.emitted, len(self.text) - self.hold_back)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
