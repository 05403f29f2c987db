"""Constrained decoding cost (issue #11): C=16 all rows JSON-schema constrained vs unconstrained,
interleaved in one run; per-token mask cost; schema compile time and its cache.

    .venv/bin/python benchmarks/structured_output.py [--rounds 8] [--tokens 32]

Both arms decode 16 greedy rows for exactly --tokens tokens (the schema asks for a long array, so
constrained rows are cut by max_tokens too, and the batch stays at 16 throughout).
"""

from __future__ import annotations

import argparse
import json
import time

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.structured.compiler import GrammarCompiler
from conveyor.structured.grammar import GrammarSpec

LONG = {"type": "object", "properties": {
    "notes": {"type": "array", "minItems": 64, "items": {"type": "object", "properties": {
        "title": {"type": "string"}, "score": {"type": "integer"}, "kind": {"enum": ["todo", "idea", "fact"]}},
        "required": ["title", "score", "kind"], "additionalProperties": False}}},
    "required": ["notes"], "additionalProperties": False}
COMPILE_SCHEMAS = {
    "small (2 fields)": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
                         "required": ["a", "b"]},
    "nested (array of objects, enum)": LONG,
    "wide (40 fields)": {"type": "object", "properties": {f"field_{i}": {"type": ["string", "number", "boolean"]}
                                                          for i in range(40)}, "required": [f"field_{i}" for i in range(40)]},
}


def _run(llm: LLM, prompts: list[list[int]], tokens: int, constrained: bool) -> tuple[float, int]:
    spec = GrammarSpec.json_schema(LONG) if constrained else None
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, structured=spec)
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(r.token_ids) for r in results)
    if constrained:  # the answers are JSON prefixes cut at max_tokens; their starts must be right
        assert all(r.text.startswith('{"notes": [') for r in results), results[0].text[:80]
    return generated / elapsed, generated


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()

    llm = LLM(parallel=args.concurrency)
    tok = llm.tokenizer
    questions = [f"Write note number {i} about the sea as JSON." for i in range(args.concurrency)]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in questions]

    start = time.perf_counter()
    compiler = llm.engine.grammars  # builds the llguidance tokenizer index
    tokenizer_seconds = time.perf_counter() - start
    _run(llm, prompts, 8, False), _run(llm, prompts, 8, True)  # warm-up (kernels, caches)
    masker = llm.engine.masker
    base = (masker.stats.num_masks, masker.stats.num_steps, masker.stats.fill_seconds,
            masker.stats.wait_seconds, masker.stats.apply_seconds)

    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for constrained in (False, True):  # interleaved: both arms see the same machine load
            rate, _ = _run(llm, prompts, args.tokens, constrained)
            rates[constrained].append(rate)
    s = masker.stats
    masks, steps = s.num_masks - base[0], s.num_steps - base[1]
    fill, wait, apply = s.fill_seconds - base[2], s.wait_seconds - base[3], s.apply_seconds - base[4]

    print(f"## C={args.concurrency}, {args.tokens} tokens per row, {args.rounds} interleaved rounds")
    print("| arm | tok/s per round | mean tok/s |\n|---|---|---|")
    for constrained in (False, True):
        values = rates[constrained]
        print(f"| {'JSON schema' if constrained else 'unconstrained'} | "
              f"{', '.join(f'{v:.1f}' for v in values)} | {sum(values) / len(values):.1f} |")
    ratio = (sum(rates[True]) / len(rates[True])) / (sum(rates[False]) / len(rates[False]))
    # On a shared machine the load swings between rounds; a pair (free, constrained) ran back to back.
    pairs = sorted(c / f for f, c in zip(rates[False], rates[True]))
    print(f"\nconstrained / unconstrained: {ratio:.1%} (ratio of means); per-pair ratios "
          f"{', '.join(f'{p:.0%}' for p in pairs)}; median {pairs[len(pairs) // 2]:.1%}\n")
    print("| mask cost | value |\n|---|---|")
    print(f"| llguidance fill per row-token (worker thread, overlapped) | {fill / masks * 1e6:.0f} us |")
    print(f"| fill per step ({masks / steps:.0f} rows) | {fill / steps * 1e3:.2f} ms |")
    print(f"| step waited for masks after its forward | {wait / steps * 1e3:.3f} ms/step |")
    print(f"| applying masks to the logits (main thread) | {apply / steps * 1e3:.2f} ms/step |")
    print(f"| step time, constrained arm | {args.concurrency / (sum(rates[True]) / len(rates[True])) * 1e3:.1f} ms |")

    print(f"\nllguidance tokenizer index (once per engine): {tokenizer_seconds * 1e3:.0f} ms\n")
    print("| schema | compile ms | cache hit ms | new request state (deep copy) ms |\n|---|---|---|---|")
    fresh = GrammarCompiler(tok, llm.engine.model_config.vocab_size)  # an empty cache
    fresh.compile(GrammarSpec.json_object())  # first-compile overheads out of the way
    for name, schema in COMPILE_SCHEMAS.items():
        spec = GrammarSpec.json_schema(schema)
        t0 = time.perf_counter()
        fresh.compile(spec)
        t1 = time.perf_counter()
        fresh.compile(GrammarSpec.json_schema(json.loads(json.dumps(schema))))
        t2 = time.perf_counter()
        fresh.new_state(spec)
        t3 = time.perf_counter()
        print(f"| {name} | {(t1 - t0) * 1e3:.1f} | {(t2 - t1) * 1e3:.3f} | {(t3 - t2) * 1e3:.3f} |")
    del compiler


if __name__ == "__main__":
    main()
