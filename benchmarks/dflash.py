"""What DFlash drafting (--draft-kind dflash --draft-model PATH) costs and gives on this machine, on a random
Llama-shaped target.

No DFlash drafter ships here, so acceptance is set by construction (conveyor.testing.write_tiny_dflash): a random
drafter (2 layers, block 4: every draft rejected, the cost of a verify round that buys nothing) and one whose first
mask row agrees with a bigram target (testing.dflash_target; one layer, block 2: one draft per step, accepted).
The drafter's layers have the target's widths. Plain decoding and DFlash with the policy pinned to decline (the
context K/V written, no drafts) frame them. Greedy, ignore_eos.
Usage: python benchmarks/dflash.py [--hidden 512] [--layers 8] [--tokens 64] [--concurrency 1,16]
"""

from __future__ import annotations

import argparse
import json
import tempfile

from conveyor.testing import dflash_target, tiny_checkpoint, write_tiny_dflash
from drafting_runs import timed_run  # noqa: E402 (a sibling script)


def _setup(hidden: int, layers: int, agree: bool):
    target = tiny_checkpoint(0, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                             num_attention_heads=hidden // 64, num_key_value_heads=2, head_dim=64,
                             tie_word_embeddings=False)
    shape = dict(num_attention_heads=hidden // 64, num_key_value_heads=2, head_dim=64, intermediate_size=3 * hidden)
    ids = [1, layers // 2, layers - 2]
    if not agree:
        return target, write_tiny_dflash(tempfile.mkdtemp(), target, target_layer_ids=ids, layer_shape=shape), 3
    target = dflash_target(target)
    return target, write_tiny_dflash(tempfile.mkdtemp(), target, target_layer_ids=ids, block_size=2, agreeing=True,
                                     layer_shape=shape), 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,16")
    args = parser.parse_args()
    results = {}
    for agree in (False, True):
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            target, drafter, k = _setup(args.hidden, args.layers, agree)
            dflash = dict(draft_kind="dflash", draft_model=drafter)
            runs = {"plain": timed_run(target, concurrency, args.tokens),
                    "dflash_declined": timed_run(target, concurrency, args.tokens, draft_policy="decline", **dflash),
                    "dflash": timed_run(target, concurrency, args.tokens, draft_policy="enable", draft_block_size=k,
                                        **dflash)}
            assert runs["dflash"]["token_ids"] == runs["plain"]["token_ids"]  # greedy: bitwise plain decoding
            for run in runs.values():
                del run["token_ids"]
            results[f"{'agreeing' if agree else 'random'} drafter (k={k}), C={concurrency}"] = runs
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
