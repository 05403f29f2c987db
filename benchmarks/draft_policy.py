"""What the adaptive draft-model policy measures and decides on this machine (SmolLM2 drafting for itself).

Runs greedy requests at each batch size until the policy settles its bucket, then prints the
verdicts (speculative vs classic tokens/s). The cache dir is a fresh temp dir, so nothing persisted
from earlier runs is reused.
Usage: python benchmarks/draft_policy.py [--batch-sizes 1,4] [--block-size 4]
"""

from __future__ import annotations

import argparse
import json
import tempfile

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.spec_policy import bucket_of
from conveyor.loading import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--block-size", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache_dir:
        llm = LLM(draft_model=default_model_path(), draft_block_size=args.block_size, parallel=16,
                  speculative_ngram=0, speculative_max_rows=128, cache_dir=cache_dir, enable_prefix_caching=False)
        policy = llm.engine.spec_policy
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            prompts = [f"Write a long story about a dragon number {i}." for i in range(batch)]
            while bucket_of(batch) not in policy.verdicts:
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
        report = llm.engine.speculation_report()
        print(json.dumps({"verdicts": report["policy"]["verdicts"], "draft_model": report["draft_model"]}, indent=1))


if __name__ == "__main__":
    main()
