"""Chat template rendering details that the SmolLM2 template does not exercise."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import models

from conveyor.loading.tokenizer import Tokenizer, build_tokenizer

TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'bad' %}{{ raise_exception('role bad is not allowed') }}{% endif %}"
    "{{ bos_token }}{{ m.role }}: {{ m.content if m.content is defined else '(none)' }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}{{ extra | default('') }}"
)


def _tokenizer(template: str | None) -> Tokenizer:
    vocab = {"<s>": 0, "</s>": 1, "<|im_end|>": 2, "a": 3}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="a"))
    return build_tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"}, template)


def test_special_tokens_tools_and_kwargs_reach_the_template() -> None:
    tools = [{"type": "function", "function": {"name": "météo", "description": "<weather>"}}]
    out = _tokenizer(TEMPLATE).apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, extra="!")
    # tojson keeps non-ASCII and does not HTML-escape, as in transformers
    assert out == ('TOOLS [{"type": "function", "function": {"name": "météo", "description": "<weather>"}}]\n'
                   "<s>user: hi</s>\nassistant:!")


def test_none_fields_are_dropped() -> None:
    messages = [{"role": "assistant", "content": None}]
    out = _tokenizer(TEMPLATE).apply_chat_template(messages, add_generation_prompt=False)
    assert out == "<s>assistant: (none)</s>\n"


def test_raise_exception_becomes_value_error() -> None:
    with pytest.raises(ValueError, match="role bad is not allowed"):
        _tokenizer(TEMPLATE).apply_chat_template([{"role": "bad", "content": "x"}])


def test_missing_template_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no chat template"):
        _tokenizer(None).apply_chat_template([{"role": "user", "content": "hi"}])


def test_end_of_turn_tokens_used_by_the_template_stop_generation() -> None:
    assert _tokenizer("{{ '<|im_end|>' }}").eos_token_ids == [1, 2]
    assert _tokenizer("plain").eos_token_ids == [1]


def test_template_runs_in_a_sandbox() -> None:
    with pytest.raises(ValueError, match="chat template error"):
        _tokenizer("{{ messages.__class__.__mro__ }}").apply_chat_template([{"role": "user", "content": "x"}])
