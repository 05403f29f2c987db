"""KV handoff between two engines: the decode engine continues bitwise where one engine would have."""

from __future__ import annotations

import pytest

from conveyor.config import EngineConfig
from conveyor.engine.engine import EngineCore
from conveyor.engine.kv_transfer import KVBlob
from conveyor.engine.request import RequestStatus
from conveyor.engine.sampling_params import SamplingParams
from conveyor.testing import tiny_hybrid_checkpoint

pytestmark = pytest.mark.batch_invariant


@pytest.fixture(scope="module")
def cores(tiny_checkpoint):
    def make(**kw):
        return EngineCore(EngineConfig(parallel=4, **kw), checkpoint=tiny_checkpoint)
    return make(), make(), make()  # single, prefill, decode


def run_all(core: EngineCore, requests) -> dict[str, list]:
    for r in requests:
        core.add_request(r)
    outs: dict[str, list] = {}
    while core.has_work():
        for out in core.step():
            outs.setdefault(out.request_id, []).append(out)
    core.pool.check_integrity()
    return outs


def prompts(core):
    tok = core.tokenizer
    return [tok.encode(t) for t in ("The capital of France is", "Once upon a time " * 6, "1 2 3 4 5 6 7 8 9 10 11 12")]


def hand_over(prefill: EngineCore, decode: EngineCore, prompt, params, rid):
    request = prefill.make_request(prompt, params, rid)
    prefill.kv_transfer.mark_for_handoff(rid)
    outs = run_all(prefill, [request])[rid]
    assert len(outs) == 1 and outs[0].finished
    handoff = outs[0].kv_handoff
    assert handoff is not None and handoff.request.status == RequestStatus.FINISHED_HANDED_OFF
    assert prefill.kv.num_blocks_held(rid) == 0  # freed on the prefill side at once
    moved = decode.make_request(prompt, params, rid)
    moved.output_token_ids = list(handoff.request.output_token_ids)
    decode.kv_transfer.check_layout(handoff.kv)
    decode.kv_transfer.stage_import(moved, handoff.kv, handoff.rng_state)
    return outs[0], moved


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                                    SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_handoff_continues_bitwise(cores, params):
    single, prefill, decode = cores
    ids = prompts(single)
    # NOTE: ids are never reused: an engine forgets a finished id's sampler state one tick later.
    tag = "s" if params.seed is not None else "g"
    reference = run_all(single, [single.make_request(p, params, f"ref-{tag}{i}") for i, p in enumerate(ids)])
    moved, firsts = [], []
    for i, p in enumerate(ids):
        first, request = hand_over(prefill, decode, p, params, f"x-{tag}{i}")
        firsts.append(first)
        moved.append(request)
    before = decode.kv_transfer.stats.num_imported
    outs = run_all(decode, moved)  # the three join one batch on the decode engine
    assert decode.kv_transfer.stats.num_imported == before + 3
    for i in range(len(ids)):
        ref = reference[f"ref-{tag}{i}"]
        ref_tokens = [t for o in ref for t in o.new_token_ids]
        got_tokens = firsts[i].new_token_ids + [t for o in outs[f"x-{tag}{i}"] for t in o.new_token_ids]
        assert got_tokens == ref_tokens
        assert firsts[i].new_text + "".join(o.new_text for o in outs[f"x-{tag}{i}"]) == "".join(o.new_text for o in ref)
        assert outs[f"x-{tag}{i}"][-1].num_output_tokens == ref[-1].num_output_tokens == 24
        assert outs[f"x-{tag}{i}"][-1].finish_reason == ref[-1].finish_reason == "length"


def test_first_token_finish_is_not_handed_off(cores):
    _, prefill, _ = cores
    request = prefill.make_request(prompts(prefill)[0], SamplingParams(max_tokens=1, temperature=0.0), "one")
    prefill.kv_transfer.mark_for_handoff("one")
    (out,) = run_all(prefill, [request])["one"]
    assert out.finished and out.finish_reason == "length" and out.kv_handoff is None
    assert not prefill.kv_transfer.handoff_ids


def test_import_without_a_free_slot_recomputes(tiny_checkpoint):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    single = EngineCore(EngineConfig(parallel=1), checkpoint=tiny_checkpoint)
    prefill = EngineCore(EngineConfig(parallel=1), checkpoint=tiny_checkpoint)
    decode = EngineCore(EngineConfig(parallel=1), checkpoint=tiny_checkpoint)
    ids = prompts(single)[:2]
    reference = run_all(single, [single.make_request(p, params, f"r{i}") for i, p in enumerate(ids)])
    moved = [hand_over(prefill, decode, p, params, f"m{i}") for i, p in enumerate(ids)]
    outs = run_all(decode, [m for _, m in moved])  # the second finds the one slot taken
    assert decode.kv_transfer.stats.num_recomputed >= 1
    for i, (first, _) in enumerate(moved):
        got = first.new_token_ids + [t for o in outs[f"m{i}"] for t in o.new_token_ids]
        assert got == [t for o in reference[f"r{i}"] for t in o.new_token_ids]


def test_abort_of_an_imported_row_frees_its_blocks(cores):
    _, prefill, decode = cores
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    _, request = hand_over(prefill, decode, prompts(decode)[1], params, "gone")
    decode.add_request(request)
    decode.step()
    assert decode.kv.num_blocks_held("gone") > 0
    out = decode.abort("gone")
    assert out.finish_reason == "abort" and decode.kv.num_blocks_held("gone") == 0
    decode.pool.check_integrity()


def test_layout_mismatch_is_refused(cores):
    _, _, decode = cores
    cfg = decode.model_config
    bad = KVBlob(cfg.num_hidden_layers + 1, 4, cfg.num_key_value_heads, cfg.head_dim, "bfloat16", b"")
    with pytest.raises(ValueError, match="layout"):
        decode.kv_transfer.check_layout(bad)
    short = KVBlob(cfg.num_hidden_layers, 4, cfg.num_key_value_heads, cfg.head_dim, "bfloat16", b"\0" * 10)
    with pytest.raises(ValueError, match="bytes"):
        decode.kv_transfer.check_layout(short)


def test_hybrid_handoff_carries_the_recurrent_state():
    """A hybrid's state travels beside its K/V: the decode engine continues bitwise, and a payload
    without the state is refused."""
    checkpoint = tiny_hybrid_checkpoint("qwen3_5_text")
    single, prefill, decode = (EngineCore(EngineConfig(parallel=4), checkpoint=checkpoint) for _ in range(3))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ids = prompts(single)
    reference = run_all(single, [single.make_request(p, params, f"h-ref{i}") for i, p in enumerate(ids)])
    handed = [hand_over(prefill, decode, p, params, f"h{i}") for i, p in enumerate(ids)]
    assert all(len(first.kv_handoff.kv.state) == decode.states.bytes_per_slot for first, _ in handed)
    outs = run_all(decode, [moved for _, moved in handed])
    for i, (first, _) in enumerate(handed):
        got = first.new_token_ids + [t for o in outs[f"h{i}"] for t in o.new_token_ids]
        assert got == [t for o in reference[f"h-ref{i}"] for t in o.new_token_ids]
    assert decode.states.all_free()
    stateless = handed[0][0].kv_handoff.kv
    with pytest.raises(ValueError, match="recurrent state"):
        decode.kv_transfer.check_layout(KVBlob(**{**vars(stateless), "state": b""}))
