"""What EAGLE3 drafting (--draft-kind eagle3 --draft-model PATH) costs and gives on this machine, on a random
Llama-shaped target.

No EAGLE3 drafter ships here, so acceptance is set by construction (conveyor.testing.write_tiny_eagle3): a random
drafter (drafts rejected: the cost of a verify round that buys nothing) and one that agrees with a bigram target
(testing.bigram_target: the target's layers output zeros, so every draft is accepted; the forwards cost what the
shapes cost). The drafter's layer has the target's widths. Plain decoding and EAGLE3 with the policy pinned to
decline (the aux hidden states recorded, fused and flushed through the drafter, no drafts) frame them. Greedy,
ignore_eos.
Usage: python benchmarks/eagle3.py [--hidden 512] [--layers 8] [--tokens 64] [--concurrency 1,16] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import tempfile

from conveyor.testing import bigram_target, tiny_checkpoint, write_tiny_eagle3
from drafting_runs import prompts, timed_run  # noqa: E402 (a sibling script)


def _setup(hidden: int, layers: int, agree: bool, tokens: int, concurrency: int):
    target = tiny_checkpoint(0, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                             num_attention_heads=hidden // 64, num_key_value_heads=2, head_dim=64,
                             tie_word_embeddings=False)
    shape = dict(num_attention_heads=hidden // 64, num_key_value_heads=2, head_dim=64, intermediate_size=3 * hidden)
    if not agree:
        return target, write_tiny_eagle3(tempfile.mkdtemp(), target, layer_shape=shape)
    target = bigram_target(target)
    ids = sorted({t for p in prompts(concurrency) for t in target.tokenizer.encode(p)})
    return target, write_tiny_eagle3(tempfile.mkdtemp(), target, agreeing=ids, agreeing_steps=tokens + 16,
                                     layer_shape=shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    results = {}
    for agree in (False, True):
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            target, drafter = _setup(args.hidden, args.layers, agree, args.tokens, concurrency)
            eagle3 = dict(draft_kind="eagle3", draft_model=drafter)
            runs = {"plain": timed_run(target, concurrency, args.tokens),
                    "eagle3_declined": timed_run(target, concurrency, args.tokens, draft_policy="decline", **eagle3),
                    "eagle3": timed_run(target, concurrency, args.tokens, draft_policy="enable",
                                        draft_block_size=args.k, **eagle3)}
            assert runs["eagle3"]["token_ids"] == runs["plain"]["token_ids"]  # greedy: bitwise plain decoding
            for run in runs.values():
                del run["token_ids"]
            results[f"{'agreeing' if agree else 'random'} drafter, C={concurrency}"] = runs
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
