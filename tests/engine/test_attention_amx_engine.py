"""The engine on the amx build's tile attention (csrc/paged_amx.h): a prompt prefilled in one chunk, in chunks of 3
and 17, and token by token gives the same greedy tokens and the same logprob bits, alone and beside 15 others.
Skipped where this process's paged attention takes the row path."""

import pytest

from conveyor.config import kernel_settings_from_env
from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.kernels import cpu_backend
from conveyor.testing import tiny_checkpoint

pytestmark = pytest.mark.batch_invariant
_attention = cpu_backend(kernel_settings_from_env()).attention
if _attention is None or _attention.paged_attention_path(16) != "amx":
    pytest.skip("paged attention takes the row path in this process", allow_module_level=True)

# ~150 tokens: the prompt's rows cross several 64-key blocks
PROMPT = "The tile path reads keys in blocks of sixty-four: " + "alpha beta gamma delta " * 30


def _run(checkpoint, chunk, prompts, max_tokens=6):
    llm = LLM(checkpoint=checkpoint, parallel=16, prefill_chunk_size=chunk, kv_cache_budget="none",
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    return [(r.token_ids, [(lp.logprob, tuple(lp.top)) for lp in r.logprobs])
            for r in llm.generate(prompts, [params] * len(prompts))]


@pytest.mark.parametrize("head_dim", [16, 64])
def test_prefill_chunks_and_token_by_token_give_the_same_bits(head_dim):
    checkpoint = tiny_checkpoint(head_dim=head_dim)
    whole = _run(checkpoint, 0, [PROMPT])
    for chunk in (3, 17, 1):
        assert _run(checkpoint, chunk, [PROMPT]) == whole, chunk
    others = [f"Row {i}: " + "epsilon zeta " * (i % 9 + 1) for i in range(15)]
    batched = _run(checkpoint, 17, [PROMPT] + others)
    assert batched[0] == whole[0]
    assert len({tuple(tokens) for tokens, _ in batched}) > 1  # not a degenerate model
