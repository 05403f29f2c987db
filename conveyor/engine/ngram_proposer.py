"""Draft tokens by prompt lookup (n-gram matching), for speculative decoding without a draft model.

The sequence's last n tokens are searched for earlier in its own prompt + output; the tokens
that followed the most recent earlier match are the draft (llama.cpp's lookup decoding, vLLM's
"ngram" method). Costs a scan of the recent context and no model; pays when the text repeats
(code edits, quoting the prompt, lists, and small models' loops).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NgramProposer:
    max_ngram: int = 3  # longest suffix tried first: longer matches predict better
    min_ngram: int = 1
    search_window: int = 2048  # only the most recent tokens are scanned, bounding the per-step cost

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to num_tokens draft tokens continuing token_ids; [] when nothing matches."""
        if num_tokens <= 0:
            return []
        window = token_ids[-self.search_window:]
        end = len(window)
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            suffix = window[end - n:]
            first = suffix[0]
            # Latest earlier occurrence of the suffix that has at least one token after it.
            for start in range(end - n - 1, -1, -1):
                if window[start] == first and window[start:start + n] == suffix:
                    return window[start + n:start + n + num_tokens]
        return []
