"""A hybrid's drafting rows keep the recurrent state after each draft (Scheduler._plan_draft_states): a miss after
accepted drafts restores the state there, so no tick recomputes them; rows the pool spares no slots for recompute,
as before. Greedy output is bitwise plain decoding either way; every state slot comes back."""

import pytest

from conveyor.engine import engine
from conveyor.engine.engine import DRAFT_STATE_ROWS
from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.testing import agreeing_mtp_head, tiny_hybrid_checkpoint

pytestmark = pytest.mark.batch_invariant

PROMPTS = [f"Echo {i}: " + "alpha beta gamma delta " * (1 + i % 4) for i in range(16)]


def _greedy(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12 + 5 * (i % 3), ignore_eos=True)


@pytest.fixture(scope="module")
def partial():
    """A head that agrees about 3 times in 4 (drafts partly accepted), and plain decoding's outputs."""
    checkpoint = agreeing_mtp_head(tiny_hybrid_checkpoint("qwen3_5_text", mtp=True, tie_word_embeddings=False),
                                   noise=0.02)
    plain = LLM(checkpoint=checkpoint, parallel=16, speculative_ngram=0)
    return checkpoint, [o.token_ids for o in plain.generate(PROMPTS, [_greedy(i) for i in range(16)])]


def _run(checkpoint, parallel: int) -> tuple[LLM, list[list[int]], list]:
    """Outputs, and every chunk the runner was handed that recomputes drafts (a decoding row's several known
    tokens: what a rollback to the real token leaves to do)."""
    llm = LLM(checkpoint=checkpoint, parallel=parallel, draft_kind="mtp", draft_policy="enable",
              speculative_max_rows=64, enable_prefix_caching=False)
    recomputes, execute = [], llm.engine.runner.execute

    def spy(plan, *args):
        for chunk in plan.chunks:
            request = llm.engine.scheduler.requests.get(chunk.request_id)
            if request is not None and request.output_token_ids and len(chunk.token_ids) > 1 + chunk.num_draft_tokens:
                recomputes.append(chunk)
        return execute(plan, *args)

    llm.engine.runner.execute = spy
    outs = llm.generate(PROMPTS[:parallel], [_greedy(i) for i in range(parallel)])
    llm.engine.kv.check_integrity()
    assert llm.engine.states.all_free()
    return llm, [o.token_ids for o in outs], recomputes


def test_rows_with_draft_states_never_recompute(partial):
    checkpoint, want = partial
    llm, got, recomputes = _run(checkpoint, DRAFT_STATE_ROWS)
    assert got == want[:DRAFT_STATE_ROWS]
    stats = llm.engine.scheduler.stats
    assert 0 < stats.num_model_accepted_tokens < 0.9 * stats.num_model_draft_tokens  # misses after accepted drafts
    assert recomputes == []
    assert llm.engine.states.num_slots == 3 * DRAFT_STATE_ROWS + 2 * DRAFT_STATE_ROWS  # k = 4: 3 states per row


@pytest.mark.parametrize("rows", [0, 1])
def test_rows_past_the_spared_slots_recompute_and_stay_exact(partial, monkeypatch, rows):
    """0: no row keeps draft states (every miss after accepted drafts recomputes them); 1: one of 4 rows does."""
    monkeypatch.setattr(engine, "DRAFT_STATE_ROWS", rows)
    checkpoint, want = partial
    llm, got, recomputes = _run(checkpoint, 4)
    assert got == want[:4]
    assert llm.engine.states.num_slots == 4 + 4 + rows * 3  # sequences, rollback points, draft states (k = 4)
    if rows == 0:
        assert recomputes


def test_draft_states_stay_within_their_share_of_the_pool(partial, monkeypatch):
    """The pool holds DRAFT_STATE_ROWS rows' worth of draft states: with free prefix-snapshot slots about, rows
    past that share take none (else a later row's rollback point or a prefix snapshot finds no slot)."""
    monkeypatch.setattr(engine, "DRAFT_STATE_ROWS", 1)
    checkpoint, want = partial
    llm = LLM(checkpoint=checkpoint, parallel=4, draft_kind="mtp", draft_policy="enable", speculative_max_rows=64,
              enable_prefix_caching=True, state_snapshots=8)
    held, execute = [], llm.engine.runner.execute

    def spy(plan, *args):
        held.append(sum(len(c.draft_state_slots) for c in plan.chunks))
        return execute(plan, *args)

    llm.engine.runner.execute = spy
    outs = llm.generate(PROMPTS[:4], [_greedy(i) for i in range(4)])
    assert [o.token_ids for o in outs] == want[:4]
    assert 0 < max(held) <= 3  # one row's worth (k = 4: 3 states)
    assert llm.engine.states.stats().num_snapshot_evictions == 0
    assert llm.engine.state_report()["max_draft_states"] == 3
    llm.engine.kv.check_integrity()
    assert llm.engine.states.all_free()


def test_draft_states_come_back_on_abort_and_a_failed_forward(partial):
    """A row aborted while its forward runs, and a forward that raises: their rollback and draft-state slots
    go back (update()'s aborted branch, release_step); the idle engine's integrity check and all_free hold."""
    checkpoint, _ = partial
    llm = LLM(checkpoint=checkpoint, parallel=4, draft_kind="mtp", draft_policy="enable", speculative_max_rows=64,
              enable_prefix_caching=False)
    events, execute = [], llm.engine.runner.execute

    def spy(plan, *args):
        held = [c for c in plan.chunks if c.draft_state_slots]
        if held and not events:
            events.append("abort")
            llm.engine.abort(held[0].request_id)  # as a client disconnect lands while the forward runs
        elif held and events == ["abort"]:
            events.append("raise")
            raise RuntimeError("injected forward failure")
        return execute(plan, *args)

    llm.engine.runner.execute = spy
    outs = llm.generate(PROMPTS[:4], [_greedy(i) for i in range(4)])
    assert events == ["abort", "raise"]
    assert any(o.error and "injected" in o.error for o in outs)
    llm.engine.kv.check_integrity()
    assert llm.engine.states.all_free() and llm.engine.states.stats().num_scratch == 0
