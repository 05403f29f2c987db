"""What MTP drafting (--draft-kind mtp) costs and gives on this machine, on a random Qwen3.5-shaped model.

No Qwen3.5 checkpoint with its MTP head ships here, so acceptance is set by construction (conveyor.testing):
a random head (drafts rejected: the cost of a verify round that buys nothing), and a head that agrees with
its target (testing.agreeing_mtp_head: the target's layers output zeros, a bigram model, so every draft is
accepted; the forwards cost what the shape costs). Plain decoding and MTP with the policy pinned to decline
(the hidden states recorded and flushed through the head, no drafts) frame them. Greedy, ignore_eos.
Usage: python benchmarks/mtp.py [--hidden 512] [--layers 8] [--tokens 64] [--concurrency 1,16] [--k 4]
"""

from __future__ import annotations

import argparse
import json

from conveyor.testing import agreeing_mtp_head, tiny_hybrid_checkpoint
from drafting_runs import timed_run  # noqa: E402 (a sibling script)


def _checkpoint(hidden: int, layers: int, agree: bool):
    kinds = tuple("full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers))
    checkpoint = tiny_hybrid_checkpoint(
        "qwen3_5_text", mtp=True, tie_word_embeddings=False, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, layer_types=kinds, num_attention_heads=hidden // 64, num_key_value_heads=2,
        head_dim=64, linear_num_key_heads=hidden // 128, linear_num_value_heads=hidden // 64,
        linear_key_head_dim=64, linear_value_head_dim=64)
    return agreeing_mtp_head(checkpoint) if agree else checkpoint


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
        checkpoint = _checkpoint(args.hidden, args.layers, agree)
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            runs = {"plain": timed_run(checkpoint, concurrency, args.tokens),
                    "mtp_declined": timed_run(checkpoint, concurrency, args.tokens, draft_kind="mtp",
                                              draft_policy="decline"),
                    "mtp": timed_run(checkpoint, concurrency, args.tokens, draft_kind="mtp", draft_policy="enable",
                                     draft_block_size=args.k)}
            assert runs["mtp"]["token_ids"] == runs["plain"]["token_ids"]  # greedy: bitwise plain decoding
            for run in runs.values():
                del run["token_ids"]
            results[f"{'agreeing' if agree else 'random'} head, C={concurrency}"] = runs
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
