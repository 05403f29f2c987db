"""Issue #44's feature x family matrix, engine side: on a tiny random checkpoint of each family class, every
engine feature gives bitwise the plain output (greedy), or is refused at startup with the reason the table
in docs/models.md ("Every feature on every family") lists. The cells the server drives (disk tier across a
restart, slot files, the KV handoff between two engines, forced tools through the server's grammars) run here
at the engine's level; their HTTP routes have their own tests, named in that table.
"""

from __future__ import annotations

import json

import pytest

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.models.config import ModelConfigError
from conveyor.structured.grammar import GrammarSpec
from conveyor.testing import (FAMILY_OVERRIDES, tiny_checkpoint, tiny_hybrid_checkpoint, tiny_mla_checkpoint,
                              tiny_moe_checkpoint)

pytestmark = pytest.mark.batch_invariant

# One family per class: what each class adds to the engine's paths.
# head_dim 32: the q8_0 cache's blocks are 32 values of one head's row.
FAMILIES = {
    "dense": lambda: tiny_checkpoint(head_dim=32),
    "sliding-window": lambda: tiny_checkpoint(**{**FAMILY_OVERRIDES["gemma3"], "head_dim": 32}),
    "moe": lambda: tiny_moe_checkpoint("qwen3_moe", head_dim=32),
    "mla": lambda: tiny_mla_checkpoint(),
    "hybrid": lambda: tiny_hybrid_checkpoint("qwen3_5_text", head_dim=32),
    "harmony": lambda: tiny_moe_checkpoint("gpt_oss", head_dim=32),  # GPT-OSS: sliding windows with sinks, experts
}
# (family, feature) -> the refusal's words; every other cell must give the plain output.
REFUSED: dict[tuple[str, str], str] = {}
SYSTEM = "You are a careful assistant who answers briefly. " * 3  # a shared prefix of ~30 tokens
PROMPTS = [SYSTEM + f"Echo {i}: " + "alpha beta gamma delta " * (1 + i % 3) for i in range(6)]
GREEDY = [SamplingParams(temperature=0, max_tokens=48 + 4 * i, ignore_eos=True) for i in range(6)]
BASE = dict(parallel=8, ctx_size=8 * 512)  # 512 tokens per slot (the least a slot may have): 32 blocks


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """(class, checkpoint, plain LLM, plain token ids): no prefix cache, no speculation, whole-prompt prefill."""
    checkpoint = FAMILIES[request.param]()
    plain = LLM(checkpoint=checkpoint, enable_prefix_caching=False, speculative_ngram=0, **BASE)
    want = [g.token_ids for g in plain.generate(PROMPTS, GREEDY)]
    assert len({tuple(w) for w in want}) > 1, "a degenerate tiny model would prove nothing"
    return request.param, checkpoint, plain, want


def _run(family, feature: str, **config) -> LLM | None:
    """The feature's LLM, or None after checking that the table's refusal is what startup says."""
    name, checkpoint, _, _ = family
    refusal = REFUSED.get((name, feature))
    if refusal is not None:
        with pytest.raises(ModelConfigError, match=refusal):
            LLM(checkpoint=checkpoint, **{**BASE, **config})
        return None
    return LLM(checkpoint=checkpoint, **{**BASE, **config})


def _released(llm: LLM) -> None:
    engine = llm.engine
    engine.kv.check_integrity()
    assert engine.pool.stats().num_used == 0


def test_prefix_cache(family):
    llm = _run(family, "prefix_cache", speculative_ngram=0)
    # Cold: the shared system text hits from the second row on where the family can (a hybrid only at a
    # state snapshot); warm: every prompt again, each hitting its own cached blocks (and snapshot).
    cold = llm.generate(PROMPTS, GREEDY)
    warm = llm.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in cold] == [w.token_ids for w in warm] == family[3]
    assert all(w.num_cached_tokens > 0 for w in warm)
    _released(llm)


def test_chunked_prefill(family):
    llm = _run(family, "chunked_prefill", prefill_chunk_size=8, enable_prefix_caching=False, speculative_ngram=0)
    assert [g.token_ids for g in llm.generate(PROMPTS, GREEDY)] == family[3]
    _released(llm)


def test_preemption(family):
    engine = family[2].engine
    states = engine.states.total_bytes if engine.states is not None else 0
    # 34 blocks beside the states and the sliding group's own (one slot's window is 32): the 6 rows grow to ~40.
    budget = states + engine.pool_plan.window_pool_bytes + 34 * engine.pool_plan.bytes_per_block
    llm = _run(family, "preemption", kv_cache_budget=str(budget), enable_prefix_caching=False, speculative_ngram=0)
    assert [g.token_ids for g in llm.generate(PROMPTS, GREEDY)] == family[3]
    assert llm.engine.scheduler.stats.num_preemptions > 0
    _released(llm)


def test_prompt_lookup(family):
    llm = _run(family, "prompt_lookup", speculative_ngram=4, speculative_max_rows=48, enable_prefix_caching=False)
    assert [g.token_ids for g in llm.generate(PROMPTS, GREEDY)] == family[3]
    assert llm.engine.scheduler.stats.num_draft_tokens > 0
    _released(llm)


def test_draft_model(family):
    llm = _run(family, "draft_model", draft_checkpoint=family[1], draft_policy="enable", speculative_ngram=0,
               speculative_max_rows=48, enable_prefix_caching=False)
    assert [g.token_ids for g in llm.generate(PROMPTS, GREEDY)] == family[3]
    stats = llm.engine.scheduler.stats
    assert stats.num_model_draft_tokens > 0 and stats.num_model_accepted_tokens == stats.num_model_draft_tokens
    _released(llm)


def test_q8_0_kv(family):
    """A quantized cache changes the numbers, so its bar is batch invariance: concurrent = one at a time."""
    llm = _run(family, "q8_0_kv", cache_type_k="q8_0", cache_type_v="q8_0", enable_prefix_caching=False,
               speculative_ngram=0)
    if llm is None:
        return
    batched = [g.token_ids for g in llm.generate(PROMPTS, GREEDY)]
    alone = [llm.generate([p], [g])[0].token_ids for p, g in zip(PROMPTS[:3], GREEDY[:3])]
    assert alone == batched[:3]
    _released(llm)


def test_structured_output(family):
    """A JSON schema holds, and a constrained row is the same alone and beside free rows."""
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
              "n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["kind", "n"],
              "additionalProperties": False}
    llm = _run(family, "structured_output", speculative_ngram=0)
    constrained = SamplingParams(temperature=0, max_tokens=40, structured=GrammarSpec.json_schema(schema))
    alone = llm.generate(PROMPTS[:1], [constrained])[0]
    beside = llm.generate(PROMPTS[:3], [constrained, GREEDY[1], GREEDY[2]])[0]
    assert set(json.loads(alone.text)) == {"kind", "n"} and beside.token_ids == alone.token_ids
    _released(llm)


def test_disk_tier(family, tmp_path):
    """--prompt-cache-dir: every prompt's prefix written at close and read back by a restart (each memory
    group: a sliding window's blocks, a hybrid's state snapshots, MLA's latent rows), bitwise."""
    first = _run(family, "disk_tier", prompt_cache_dir=str(tmp_path), speculative_ngram=0)
    assert [g.token_ids for g in first.generate(PROMPTS, GREEDY)] == family[3]
    _released(first)
    first.engine.close()
    again = _run(family, "disk_tier", prompt_cache_dir=str(tmp_path), speculative_ngram=0)
    warm = again.generate(PROMPTS, GREEDY)
    assert [w.token_ids for w in warm] == family[3]
    assert all(w.num_cached_tokens > 0 for w in warm) and again.engine.disk_report()["hits"] > 0
    _released(again)
    again.engine.close()


def test_slot_files(family, tmp_path):
    """--slot-save-path: a slot saved on one engine and restored on a fresh one resumes after its prefix."""
    from conveyor.engine import slot_store

    first = _run(family, "slot_files", slot_save_path=str(tmp_path), speculative_ngram=0)
    first.generate(PROMPTS[:1], GREEDY[:1])
    first.engine.slot_contents[0] = first.tokenizer.encode(PROMPTS[0])
    saved = slot_store.save(first.engine, 0, str(tmp_path), "slot.bin")
    first.engine.close()
    again = _run(family, "slot_files", slot_save_path=str(tmp_path), speculative_ngram=0)
    restored = slot_store.restore(again.engine, 0, str(tmp_path), "slot.bin")
    assert restored["n_restored"] == saved["n_saved"] > 0
    result = again.generate(PROMPTS[:1], GREEDY[:1])[0]
    assert result.token_ids == family[3][0] and result.num_cached_tokens >= saved["n_saved"]
    _released(again)
    again.engine.close()


def test_kv_handoff(family):
    """Disaggregated nodes: each prompt prefilled on one engine, its KV (and a hybrid's state) handed to
    another that decodes the rest, all of them joining one batch there: bitwise the plain output."""
    prefill = _run(family, "kv_handoff", speculative_ngram=0, enable_prefix_caching=False)
    decode = _run(family, "kv_handoff", speculative_ngram=0, enable_prefix_caching=False)
    moved, firsts = [], []
    for i, (prompt, params) in enumerate(zip(PROMPTS, GREEDY)):
        ids = prefill.tokenizer.encode(prompt)
        request = prefill.engine.make_request(ids, params, f"h{i}")
        prefill.engine.kv_transfer.mark_for_handoff(request.request_id)
        prefill.engine.add_request(request)
        while prefill.engine.has_work():
            for out in prefill.engine.step():
                if out.kv_handoff is not None:
                    firsts.append(out)
        handoff = firsts[-1].kv_handoff
        request = decode.engine.make_request(ids, params, f"h{i}")
        request.output_token_ids = list(handoff.request.output_token_ids)
        decode.engine.kv_transfer.check_layout(handoff.kv)
        decode.engine.kv_transfer.stage_import(request, handoff.kv, handoff.rng_state)
        moved.append(request)
    for request in moved:
        decode.engine.add_request(request)
    rest: dict[str, list[int]] = {}
    while decode.engine.has_work():
        for out in decode.engine.step():
            rest.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert decode.engine.kv_transfer.stats.num_imported == len(PROMPTS)
    got = [first.new_token_ids + rest[first.request_id] for first in firsts]
    assert got == family[3]
    _released(prefill)
    _released(decode)


def test_forced_tools(family):
    """tool_choice required: the server's grammar for the family's call format (harmony's commentary message to
    functions.NAME, else Hermes' <tool_call> JSON) gives a valid call, the same alone and beside free rows."""
    from conveyor.structured.harmony import harmony_tool_grammar
    from conveyor.structured.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, tool_grammar

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}]
    harmony = family[0] == "harmony"
    grammar = harmony_tool_grammar(tools, None) if harmony else tool_grammar(tools, None, parallel=False)
    llm = _run(family, "forced_tools", speculative_ngram=0)
    forced = SamplingParams(temperature=0, max_tokens=60, structured=grammar)
    alone = llm.generate(PROMPTS[:1], [forced])[0]
    beside = llm.generate(PROMPTS[:3], [forced, GREEDY[1], GREEDY[2]])[0]
    assert beside.token_ids == alone.token_ids and alone.finish_reason == "stop"
    if harmony:
        header, _, arguments = alone.text.partition("<|message|>")
        assert "to=functions.get_weather" in header
    else:
        body = alone.text.strip().removeprefix(TOOL_CALL_OPEN).removesuffix(TOOL_CALL_CLOSE)
        call = json.loads(body)
        assert call["name"] == "get_weather"
        arguments = json.dumps(call["arguments"])
    assert json.loads(arguments)["city"] in ("Paris", "Rome")
    _released(llm)
