"""Constrained decoding in the engine, on a tiny random model: a random model under a grammar still
writes valid output; masks are per row, so constrained output is batch-invariant; preemption keeps
the grammar state consistent."""

import json

import jsonschema
import pytest

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.errors import InvalidRequestError
from conveyor.structured.grammar import GrammarSpec

# Bounded everywhere (enums, ranges, lengths, item counts), so even random weights must finish.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
                  "required": ["id"], "additionalProperties": False},
    },
    "required": ["name", "kind", "age", "ok", "tags", "owner"],
    "additionalProperties": False,
}
# Short answers for the tests that run the same request several times.
SMALL = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0,
         "maximum": 99}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
         "required": ["kind", "n", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(checkpoint=tiny_checkpoint, parallel=16, prefill_chunk_size=64)


def _params(spec: GrammarSpec | None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 160), temperature=kw.pop("temperature", 0),
                          structured=spec, **kw)


def test_random_model_under_a_schema_writes_valid_json(llm):
    spec = GrammarSpec.json_schema(SCHEMA)
    params = [_params(spec)] + [_params(spec, temperature=1.0, seed=s) for s in range(4)]
    results = llm.generate([f"prompt {i}" for i in range(5)], params)
    for r in results:
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)
    assert len({r.text for r in results}) > 1  # the masks constrain, they do not pick the answer
    llm.engine.pool.check_integrity()


def test_other_grammars(llm):
    specs = [GrammarSpec("regex", r"[a-z]{2,4}-[0-9]{3}"), GrammarSpec.choice(["yes", "no", "maybe"]),
             GrammarSpec("lark", 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'), GrammarSpec.json_object()]
    results = llm.generate(["a", "b", "c", "d"], [_params(s, max_tokens=40) for s in specs])
    import re
    assert re.fullmatch(r"[a-z]{2,4}-[0-9]{3}", results[0].text)
    assert results[1].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"\(\d{1,2}(,\d{1,2})*\)", results[2].text) or results[2].finish_reason == "length"
    assert all(r.finish_reason == "stop" for r in results[:2])
    assert results[3].text.startswith("{")  # any object: may run to max_tokens on random weights


@pytest.mark.batch_invariant
def test_constrained_greedy_is_batch_invariant(llm):
    spec = GrammarSpec.json_schema(SMALL)
    prompt = "Describe a pet as JSON."
    alone = llm.generate([prompt], [_params(spec)])[0]
    # 15 batch-mates: other schemas, other grammars, free greedy and free sampled rows.
    mates = [_params(GrammarSpec("regex", r"[0-9]{1,12}"))] * 5 + [_params(GrammarSpec.json_object(), max_tokens=12)] * 4 \
        + [_params(None, max_tokens=12, ignore_eos=True)] * 3 + [_params(None, temperature=1.0, seed=3, max_tokens=12)] * 3
    batch = llm.generate([prompt] + [f"mate {i} " * (i + 1) for i in range(15)], [_params(spec)] + mates)
    assert batch[0].token_ids == alone.token_ids
    jsonschema.validate(json.loads(alone.text), SMALL)
    free_alone = llm.generate(["mate 9 " * 10], [mates[9]])[0]
    assert batch[10].token_ids == free_alone.token_ids  # a free row next to constrained ones is untouched
    llm.engine.pool.check_integrity()


def test_preempted_constrained_row_resumes_its_grammar(llm):
    spec = GrammarSpec.json_schema(SMALL)
    expected = llm.generate(["resume me"], [_params(spec)])[0]
    engine = llm.engine
    request = engine.make_request(engine.tokenizer.encode("resume me"), _params(spec))
    engine.add_request(request)
    tokens, steps = [], 0
    while engine.has_work():
        for out in engine.step():
            tokens += out.new_token_ids
        steps += 1
        if steps in (3, 6) and request in engine.scheduler.running:
            engine.scheduler.preempt(request)  # KV dropped; it re-prefills prompt + output so far
    assert request.num_preemptions == 2
    assert tokens == expected.token_ids
    jsonschema.validate(json.loads(engine.tokenizer.decode(tokens)), SMALL)


def test_bad_grammars_are_refused_before_admission(llm):
    engine = llm.engine
    for spec, param in [(GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "wat"}}}),
                         "response_format"), (GrammarSpec("regex", "(unclosed"), "guided_regex"),
                        (GrammarSpec("lark", "start: missing_rule"), "guided_grammar")]:
        with pytest.raises(InvalidRequestError) as info:
            engine.make_request([1, 2, 3], _params(spec))
        assert info.value.param == param and str(info.value).startswith("invalid ")
    assert not engine.has_work()


def test_compiled_grammars_are_cached(llm):
    compiler = llm.engine.grammars
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"cache_probe": {"type": "integer"}}})
    hits, compiled = compiler.stats.num_cache_hits, compiler.stats.num_compiled
    first = compiler.compile(spec)
    assert compiler.compile(GrammarSpec.json_schema({"type": "object", "properties": {"cache_probe": {"type": "integer"}}})) is first
    assert (compiler.stats.num_compiled, compiler.stats.num_cache_hits) == (compiled + 1, hits + 1)
    # Each request gets its own copy: advancing one does not move the cached start state.
    a, b = compiler.new_state(spec), compiler.new_state(spec)
    assert a.accept(llm.tokenizer.encode("{")[0])
    assert b.matcher is not a.matcher and not first.is_stopped()


def test_only_constrained_rows_get_masks(llm):
    llm.engine.grammars  # noqa: B018 (builds the masker when this test runs alone)
    masker = llm.engine.masker
    before = (masker.stats.num_masks, masker.stats.num_steps)
    constrained, free = llm.generate(["x", "y"], [_params(GrammarSpec("regex", r"[a-z]{8}")),
                                                  _params(None, max_tokens=12, ignore_eos=True)])
    masks, steps = masker.stats.num_masks - before[0], masker.stats.num_steps - before[1]
    assert len(constrained.text) == 8 and len(free.token_ids) == 12
    # One mask per constrained row-step; the free row, which ran longer, never got one.
    assert masks == steps == len(constrained.token_ids)
