"""Where an MTP round's time goes at C=1 (issue #43): one request's engine steps grouped by the target's rows (a
plain step: 1; a verify: k + 1), each part timed with hybrid_profile's nested timers, the MTP head's own linears,
glue and runner calls included (labels "HEAD ...").

Usage (the results.md section's table):
  python benchmarks/mtp_round_profile.py FILE.gguf plain [--steps 30]
  python benchmarks/mtp_round_profile.py FILE.gguf mtp --draft-vocab DIR/tokenizer-ids.txt [--draft-vocab-type q4_0]
Prints, per row count seen at least 3 times, the median wall time of the step and of each part (>= 0.1 ms).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from hybrid_profile import Timers, instrument  # noqa: E402

from conveyor.engine.llm import LLM  # noqa: E402
from conveyor.engine.sampling_params import SamplingParams  # noqa: E402
from conveyor.models.layers import RowInvariantLinear  # noqa: E402
from conveyor.models.mtp import MTPHead  # noqa: E402
from conveyor.runner import model_runner, mtp_runner  # noqa: E402


def instrument_head(timers: Timers) -> None:
    for head in (o for o in gc.get_objects() if isinstance(o, MTPHead)):
        for name, module in head.named_modules():
            if isinstance(module, RowInvariantLinear):
                module.forward = timers.wrap(f"HEAD gemm {name}", module.forward)
        head.forward = timers.wrap("HEAD forward glue", head.forward)
        head.draft_logits = timers.wrap("HEAD draft_logits", head.draft_logits)
        head.layer.forward = timers.wrap("HEAD layer glue", head.layer.forward)
        for i, mixer in enumerate(head.layer.mixers):
            mixer.forward = timers.wrap(f"HEAD mixer{i} glue", mixer.forward)
    for name in ("_forward", "propose", "record"):
        setattr(mtp_runner.MTPRunner, name, timers.wrap(f"HEAD {name}", getattr(mtp_runner.MTPRunner, name)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file")
    p.add_argument("mode", choices=("plain", "mtp"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--draft-vocab")
    p.add_argument("--draft-vocab-type", default="same")
    args = p.parse_args()
    engine_args = {}
    if args.mode == "mtp":
        engine_args = {"draft_kind": "mtp", "draft_policy": "enable", "draft_block_size": args.k}
        if args.draft_vocab:
            engine_args |= {"draft_vocab": args.draft_vocab, "draft_vocab_type": args.draft_vocab_type}
    llm = LLM(model=args.file, parallel=1, speculative_ngram=0, speculative_max_rows=128,
              enable_prefix_caching=False, **engine_args)
    timers = Timers()
    instrument(llm, timers)
    instrument_head(timers)
    rows_seen: list[int] = []
    forward = model_runner.ModelRunner.forward

    def counting(self, plan, *rest, **kwargs):
        rows_seen.append(sum(len(c.token_ids) for c in plan.chunks))
        return forward(self, plan, *rest, **kwargs)
    model_runner.ModelRunner.forward = counting
    engine = llm.engine
    ids = [(7919 * j) % 40000 + 50 for j in range(48)]
    engine.add_request(engine.make_request(ids, SamplingParams(max_tokens=args.steps * (args.k + 1) + 20,
                                                               temperature=0.0, ignore_eos=True)))
    for _ in range(4):  # prefill and the first steps untimed
        engine.step()
    by_rows: dict[tuple, list[dict]] = defaultdict(list)
    calls_by: dict[tuple, dict] = {}
    timers.on = True
    for _ in range(args.steps):
        rows_seen.clear()
        started = time.perf_counter()
        engine.step()
        wall = (time.perf_counter() - started) * 1e3
        step, calls = timers.take()
        step["__wall"] = wall
        by_rows[tuple(rows_seen)].append(step)
        calls_by[tuple(rows_seen)] = calls
    timers.on = False
    for key, steps in sorted(by_rows.items(), key=lambda kv: -len(kv[1])):
        if len(steps) < 3:
            continue
        print(f"\n## target rows {key}: {len(steps)} steps, wall median "
              f"{statistics.median(s['__wall'] for s in steps):.1f} ms")
        labels = sorted({label for s in steps for label in s if label != "__wall"},
                        key=lambda label: -statistics.median(s.get(label, 0.0) for s in steps))
        for label in labels:
            median = statistics.median(s.get(label, 0.0) for s in steps)
            if median >= 0.1:
                print(f"{label:60s} {calls_by[key].get(label, 0):4d} {median:7.2f}")


if __name__ == "__main__":
    main()
