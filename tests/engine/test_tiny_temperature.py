"""A temperature too small to divide by is greedy (logits / 1e-308 would be +-inf, the softmax NaN)."""

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams


def test_the_greedy_threshold():
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=1e-308).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy and not SamplingParams(temperature=0.7).greedy


def test_a_vanishing_temperature_decodes_as_greedy(tiny_checkpoint):
    llm = LLM(checkpoint=tiny_checkpoint, parallel=2)
    prompts = ["Once upon a time", "The capital of"]
    greedy = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    tiny = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=1e-308, ignore_eos=True, seed=3))
    assert [t.token_ids for t in tiny] == [g.token_ids for g in greedy]
