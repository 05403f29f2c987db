"""SmolLM2-135M-Instruct end to end: agreement with transformers, and batch invariance in bf16."""

import functools
import os

import gguf
import pytest
import torch

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.loading import default_model_path, load_checkpoint
from conveyor.loading.gguf_loader import _Reader

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
             "Explain gravity to a child in one sentence."]


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(None)


def _chat_ids(tokenizer, question):
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture
def fast_gguf_parse(monkeypatch):
    """transformers' own GGUF loading, minus two costs that are gguf-py's, not transformers' logic (75 s -> 32 s
    measured): the file's fields parsed by our faster reader (same values), and the tensor-name map
    built once instead of once per module (transformers asks get_tensor_name_map 397 times)."""
    monkeypatch.setattr(gguf, "GGUFReader", _Reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))


def test_greedy_matches_transformers_float32(checkpoint, fast_gguf_parse):
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           dtype=torch.float32).eval()
    llm = LLM(checkpoint=checkpoint, dtype="float32", parallel=4)
    prompts = [_chat_ids(llm.tokenizer, q) for q in QUESTIONS[:3]]
    ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    for ids, got in zip(prompts, ours):
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                               eos_token_id=llm.tokenizer.eos_token_ids)[0, len(ids):].tolist()
        assert got.token_ids == want
        assert got.finish_reason == ("stop" if want[-1] in llm.tokenizer.eos_token_ids else "length")


@pytest.mark.batch_invariant
def test_sixteen_concurrent_bf16_requests_equal_one_at_a_time(checkpoint):
    llm = LLM(checkpoint=checkpoint, parallel=16)
    prompts = [_chat_ids(llm.tokenizer, QUESTIONS[i % 4] + " " * (i // 4) + ("Be brief." if i % 3 else ""))
               for i in range(16)]
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * (i % 5)) for i in range(16)]
    batched = llm.generate(prompts, params)
    for ids, p, got in zip(prompts, params, batched):
        alone = llm.generate([ids], [p])[0]
        assert got.token_ids == alone.token_ids and got.text == alone.text
    seeded = [SamplingParams(temperature=0.8, max_tokens=12, seed=7 + i) for i in range(16)]
    batched = llm.generate(prompts, seeded)
    for i in (0, 9):
        assert llm.generate([prompts[i]], [seeded[i]])[0].token_ids == batched[i].token_ids
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.stats().num_used == 0
