"""The SmolLM2 tokenizer built from GGUF metadata must match transformers' tokenizer for the same file."""

from __future__ import annotations

import pytest

from conveyor.loading import Checkpoint, Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing   ",
    "naïve café — Übermäßig 東京 🤖🚀",
    "Ελληνικά, русский, العربية, हिन्दी",
    "def f(x):\n\treturn x**2  # square\n",
    'int main() { printf("%d\\n", 1 << 3); }',
    "1234567890 3.14159 -42 1e10 a 12",
    "I'm sure you're right; they'll see WE'VE won",
    "\n\n\n  \t \r\n",
    "a\r\nb\u00a0c\u200bd",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<repo_name>x <|im_end|><|im_end|>",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "ünïcödé and <b>tags</b>"}],
]


@pytest.fixture(scope="module")
def tok(smollm: Checkpoint) -> Tokenizer:
    return smollm.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(tok: Tokenizer, hf_gguf_tokenizer, text: str) -> None:
    assert tok.encode(text) == hf_gguf_tokenizer.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf_gguf_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tok: Tokenizer, hf_gguf_tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_gguf_tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.encode("<|im_start|>") == [1]  # whole, never split
    assert tok.encode("hi") == [6004]  # SmolLM2 adds no BOS
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == [2]  # <|im_end|>: the eos and the template's end of turn
    assert tok.id_to_piece(2) == "<|im_end|>" and tok.id_to_piece(905) == "Ġworld"
    with pytest.raises(IndexError):
        tok.id_to_piece(10**6)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, hf_gguf_tokenizer, messages, add_generation_prompt) -> None:
    expected = hf_gguf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


# llama-server (llama.cpp's own `gemma4` tokenizer) on the tiny vocabulary below gave these ids, BOS first: BPE by
# merges over the whole text (spaces as U+2581), runs of newlines split off and taken whole when they are a token
# (else BPE on them: no merge joins two "\n"), a user-defined token matched whole, byte fallback for é
# (tests/loading/tiny_checkpoints.py add_tiny_gemma4_vocab; checked by hand against llama-server's /tokenize).
GEMMA4_IDS = {"hello world": [2, 6, 19, 20, 27], " hello world\n\nabc": [2, 22, 27, 17, 29],
              "abc\n\n\nhello<|channel>w": [2, 29, 16, 16, 16, 6, 19, 20, 4, 10], "héllo": [2, 6, 225, 199, 8, 20]}


def test_gemma4_tokenizer_matches_llama_cpp(tmp_path) -> None:
    import gguf
    from tiny_checkpoints import add_tiny_gemma4_vocab

    from conveyor.loading.gguf_tokenizer import tokenizer_from_gguf

    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma4")
    add_tiny_gemma4_vocab(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = tokenizer_from_gguf(gguf.GGUFReader(str(path)), str(path))
    for text, ids in GEMMA4_IDS.items():
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == text  # BOS skipped; the user-defined token shown, as the converter means it
