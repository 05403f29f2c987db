"""What benchmarks/mtp.py and benchmarks/eagle3.py share: the prompts and one timed offline run of a drafter
configuration (tokens/s, drafted and accepted counts, and the token ids to check against plain decoding)."""

from __future__ import annotations

import time

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams


def prompts(concurrency: int) -> list[str]:
    return [f"Request {i}: tell me about the number {i}." for i in range(concurrency)]


def timed_run(checkpoint, concurrency: int, tokens: int, **engine) -> dict:
    """Greedy completions of `tokens` tokens for `concurrency` prompts at once, after a short warm-up."""
    llm = LLM(checkpoint=checkpoint, parallel=concurrency, speculative_ngram=0, speculative_max_rows=128,
              enable_prefix_caching=False, **engine)
    asked = prompts(concurrency)
    llm.generate(asked, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm up
    started = time.perf_counter()
    outs = llm.generate(asked, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    seconds = time.perf_counter() - started
    stats = llm.engine.scheduler.stats
    return {"tokens_per_s": round(sum(len(o.token_ids) for o in outs) / seconds, 1),
            "drafted": stats.num_model_draft_tokens, "accepted": stats.num_model_accepted_tokens,
            "token_ids": [o.token_ids for o in outs]}
