"""Response shapes that need no server: token bytes, usage accounting."""

from __future__ import annotations

from conveyor.server.responses import ChoiceState, TokenText, usage
from conveyor.testing import smollm_tokenizer


def test_token_bytes_are_exact_for_half_characters():
    tokenizer = smollm_tokenizer()
    ids = tokenizer.encode("你好 – é", add_special_tokens=False)
    token_text = TokenText(tokenizer)
    raw = b"".join(bytes(token_text(i)[1]) for i in ids)
    assert raw.decode() == "你好 – é"
    assert any(token_text(i)[0] == "\ufffd" for i in ids)  # some tokens are half a character as text


def test_a_token_past_the_tokenizer_has_no_text():
    """Models pad their embeddings past the tokenizer (Qwen: 151,936 rows, ~151,670 tokens); sampling a padding id
    with logprobs on was an IndexError (a 500) on the whole response."""
    tokenizer = smollm_tokenizer()
    assert TokenText(tokenizer)(tokenizer.vocab_size + 5) == ("", [])


def test_usage_counts_each_prompt_once():
    choices = [ChoiceState(i, num_prompt_tokens=p, num_output_tokens=o, num_cached_tokens=c)
               for i, (p, o, c) in enumerate([(10, 3, 0), (10, 4, 8), (5, 1, 0), (5, 2, 0)])]
    assert usage(choices, n=2) == {"prompt_tokens": 15, "completion_tokens": 10, "total_tokens": 25,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
