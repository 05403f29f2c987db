"""Scheduler policies against hand-built runner outputs: no model, milliseconds per test."""

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.engine.block_pool import BlockPool
from conveyor.engine.kv_cache_manager import KVCacheManager
from conveyor.engine.outputs import ModelRunnerOutput
from conveyor.engine.request import Request, RequestStatus
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.scheduler import Scheduler, _skip_ticks
from conveyor.engine.scheduling_policy import SchedulerConfig

BLOCK = 4


def make(num_blocks=64, caching=False, **config) -> Scheduler:
    config.setdefault("max_model_len", 512)
    return Scheduler(SchedulerConfig(**config), KVCacheManager(BlockPool(num_blocks, caching), BLOCK))


def request(rid, prompt_len, max_tokens=8, priority=0, arrival=0.0):
    return Request(rid, [(i * 7 + len(rid)) % 50 for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority, arrival_time=arrival)


def tick(s: Scheduler, token=3):
    """One engine step with a fake runner that samples `token` for every sampling row."""
    plan = s.schedule()
    result = ModelRunnerOutput(sampled_token_ids={c.request_id: token for c in plan.chunks if c.sample})
    s.update(plan, result)
    return plan


def run_to_completion(s: Scheduler, limit=10_000):
    for _ in range(limit):
        if not s.has_work():
            return
        tick(s)
    raise AssertionError("scheduler did not drain")


def test_mixed_tick_carries_decode_and_prefill_chunk():
    s = make(max_batch_size=4, prefill_chunk_size=8, tick_policy="mixed")
    s.add_request(request("a", 5))
    tick(s)  # a prefills whole and samples
    s.add_request(request("b", 20))
    plan = tick(s)
    sizes = {c.request_id: len(c.token_ids) for c in plan.chunks}
    assert sizes == {"a": 1, "b": 8}
    assert s.stats.num_mixed_steps == 1


def test_alternate_grant_interval_bounds_parked_prefill():
    interval, chunk = 3, 8
    s = make(max_batch_size=4, prefill_chunk_size=chunk, tick_policy="alternate", prefill_grant_interval=interval)
    for rid in ("a", "b"):
        s.add_request(request(rid, 4, max_tokens=500))
    tick(s)
    long_prompt = 5 * chunk
    s.add_request(request("long", long_prompt, max_tokens=2))
    ticks = 0
    while not s.requests["long"].output_token_ids:
        plan = tick(s)
        ticks += 1
        kinds = {len(c.token_ids) == 1 and c.sample for c in plan.chunks}
        assert len(kinds) == 1  # alternate: never both decode and prefill in one forward
    num_chunks = long_prompt // chunk
    assert ticks <= num_chunks * (interval + 1)
    assert s.stats.num_prefill_grants == num_chunks - 1


def test_grant_interval_zero_waits_for_decode_to_finish():
    s = make(max_batch_size=4, prefill_chunk_size=8, tick_policy="alternate", prefill_grant_interval=0)
    s.add_request(request("a", 4, max_tokens=30))
    tick(s)
    s.add_request(request("long", 24, max_tokens=2))
    for _ in range(20):
        tick(s)
    assert s.requests["long"].num_computed_tokens == 8  # parked after chunk 0 while "a" decodes
    run_to_completion(s)


def test_max_batch_prefill_and_token_cap():
    s = make(max_batch_size=8, prefill_chunk_size=64, max_batch_prefill=3)
    for i in range(6):
        s.add_request(request(f"r{i}", 10))
    plan = tick(s)
    assert len(plan.chunks) == 3
    s = make(max_batch_size=8, prefill_chunk_size=64, max_batch_prefill=4, max_batch_prefill_tokens=25)
    for i in range(4):
        s.add_request(request(f"r{i}", 10))
    assert len(tick(s).chunks) == 2  # a third 10-token prompt would pass the 25-token cap


def test_priority_preemption_longest_first():
    s = make(max_batch_size=2, enable_preemption=True, tick_policy="mixed")
    s.add_request(request("low-long", 4, max_tokens=50))
    tick(s)
    s.add_request(request("low-short", 4, max_tokens=50))
    for _ in range(3):
        tick(s)
    s.add_request(request("high", 4, priority=5))
    tick(s)
    running = {r.request_id for r in s.running}
    assert "high" in running and "low-long" not in running
    victim = s.requests["low-long"]
    assert victim.status == RequestStatus.QUEUED and victim.num_computed_tokens == 0
    assert len(victim.output_token_ids) == 4  # generated tokens are kept for the re-prefill
    run_to_completion(s)
    assert s.kv.pool.all_free() and s.stats.num_preemptions == 1


def test_priority_preemption_lowest_priority_and_disabled():
    s = make(max_batch_size=2, enable_preemption=True, preemption_policy="lowest-priority")
    s.add_request(request("p1", 4, max_tokens=50, priority=1))
    s.add_request(request("p0", 4, max_tokens=50, priority=0, arrival=1.0))
    tick(s)
    s.add_request(request("p9", 4, priority=9))
    tick(s)
    assert {r.request_id for r in s.running} == {"p1", "p9"}
    off = make(max_batch_size=1)
    off.add_request(request("a", 4, max_tokens=50))
    tick(off)
    off.add_request(request("vip", 4, priority=9))
    tick(off)
    assert [r.request_id for r in off.running] == ["a"] and off.stats.num_preemptions == 0


def test_higher_priority_waits_first_in_queue():
    s = make(max_batch_size=1)
    s.add_request(request("first", 4, max_tokens=2))
    order = [tick(s).chunks[0].request_id]
    s.add_request(request("later-low", 4, max_tokens=2, arrival=1.0))
    s.add_request(request("later-high", 4, max_tokens=2, priority=3, arrival=2.0))
    while s.has_work():
        for c in tick(s).chunks:
            if c.start_position == 0:
                order.append(c.request_id)
    assert order == ["first", "later-high", "later-low"]


def _admitted_under_a_high_priority_stream(aging_s, seconds_per_tick=0.1, ticks=400):
    """A priority-0 request queued at t=0 behind one new priority-5 arrival every tick (more than one
    slot can serve); returns the tick at which it was admitted, or None."""
    s = make(max_batch_size=1, priority_aging_s=aging_s)
    s.add_request(request("busy", 4, max_tokens=2, priority=5, arrival=0.0))
    tick(s)
    s.add_request(request("low", 4, max_tokens=2, priority=0, arrival=0.0))
    for i in range(1, ticks):
        s.add_request(request(f"high-{i}", 4, max_tokens=2, priority=5, arrival=i * seconds_per_tick))
        plan = tick(s)
        if any(c.request_id == "low" for c in plan.chunks):
            return i
    return None


def test_aging_admits_a_low_priority_request_under_a_steady_high_priority_stream():
    # Without aging the stream holds it back for the whole run; with 1 s per level it overtakes the
    # arrivals that came more than 5 s (gap 5 x 1 s) after it, and runs once those ahead have drained.
    assert _admitted_under_a_high_priority_stream(aging_s=0.0) is None
    admitted = _admitted_under_a_high_priority_stream(aging_s=1.0)
    assert admitted is not None and 5.0 / 0.1 <= admitted <= 400
    assert _admitted_under_a_high_priority_stream(aging_s=0.5) < admitted  # faster aging, sooner


def test_aging_orders_the_queue_by_priority_plus_wait():
    s = make(max_batch_size=1, priority_aging_s=2.0)
    s.add_request(request("busy", 4, max_tokens=2))
    tick(s)
    s.add_request(request("old-low", 4, max_tokens=2, priority=0, arrival=0.0))
    s.add_request(request("new-high", 4, max_tokens=2, priority=1, arrival=1.0))  # 1 level = 2 s: ahead
    s.add_request(request("newer-high", 4, max_tokens=2, priority=1, arrival=3.0))  # waited 3 s less: behind
    assert [r.request_id for r in s.waiting] == ["new-high", "old-low", "newer-high"]


def test_aging_leaves_preemption_to_raw_priorities():
    """docs/scheduling.md: an arrival evicts only a row of strictly lower priority; waiting long does
    not raise a request's priority for eviction, only its place in the queue."""
    s = make(max_batch_size=1, enable_preemption=True, priority_aging_s=1.0)
    s.add_request(request("high", 4, max_tokens=50, priority=5, arrival=100.0))
    tick(s)
    s.add_request(request("aged-low", 4, max_tokens=2, priority=0, arrival=0.0))  # aged past 5 levels
    for _ in range(3):
        tick(s)
    assert [r.request_id for r in s.running] == ["high"] and s.stats.num_preemptions == 0
    # A higher arrival behind the aged head still waits its turn; at the head it evicts as before.
    s.add_request(request("vip", 4, max_tokens=2, priority=9, arrival=101.0))
    tick(s)
    assert [r.request_id for r in s.waiting][:1] == ["aged-low"] and s.stats.num_preemptions == 0
    run_to_completion(s)
    assert s.kv.pool.all_free()


def test_dry_pool_preempts_least_progressed_row_and_nothing_is_lost():
    s = make(num_blocks=6, max_batch_size=3)
    for i in range(3):
        s.add_request(request(f"r{i}", 4, max_tokens=12, arrival=float(i)))
    run_to_completion(s)
    assert s.stats.num_preemptions > 0 and s.stats.num_reclaim_passes > 0
    assert s.stats.finished_by_reason == {"length": 3}
    s.kv.pool.check_integrity()
    assert s.kv.pool.all_free()


def test_watermark_holds_back_admission_while_decoding():
    s = make(num_blocks=20, max_batch_size=4, kv_admission_watermark=0.25)
    s.add_request(request("a", 4, max_tokens=100))
    tick(s)
    s.add_request(request("b", 48))  # needs 12 blocks; 19 free minus 5 reserved = 14, fits
    tick(s)
    assert "b" in {r.request_id for r in s.running}
    s.add_request(request("c", 8))  # 2 blocks; free is 7 minus 5 reserved = 2, fits
    tick(s)
    s.add_request(request("d", 8))
    tick(s)
    assert s.requests["d"].status == RequestStatus.QUEUED  # would eat into the watermark
    assert s.requests["a"].status == RequestStatus.DECODING


def test_adaptive_chunk_size():
    s = make(num_blocks=2000, max_batch_size=4, max_model_len=8192)
    s.add_request(request("big", 3000, max_tokens=2))
    assert len(tick(s).chunks[0].token_ids) == 2048  # nothing decoding
    s2 = make(num_blocks=2000, max_batch_size=4, max_model_len=8192, tick_policy="mixed")
    s2.add_request(request("a", 4, max_tokens=100))
    tick(s2)
    s2.add_request(request("big", 3000, max_tokens=2))
    sizes = [len(c.token_ids) for c in tick(s2).chunks]
    assert sorted(sizes) == [1, 512]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "tick", "abort", "preempt"]), st.integers(1, 40),
                          st.integers(0, 3)), max_size=50),
       st.sampled_from(["mixed", "alternate"]), st.booleans(), st.sampled_from([0.0, 0.5, 10.0]))
def test_random_traffic_keeps_pool_integrity(ops, policy, caching, aging_s):
    s = make(num_blocks=24, caching=caching, max_batch_size=3, prefill_chunk_size=8, tick_policy=policy,
             enable_preemption=True, priority_aging_s=aging_s)
    n = 0
    for op, size, prio in ops:
        if op == "add":
            s.add_request(request(f"q{n}", size % 30 + 1, max_tokens=size % 9 + 1, priority=prio, arrival=float(n)))
            n += 1
        elif op == "tick":
            tick(s, token=size % 50)
        elif op == "abort" and s.requests:
            s.finish(sorted(s.requests)[size % len(s.requests)], RequestStatus.FINISHED_CANCELLED)
        elif op == "preempt" and s.running:
            s.preempt(s.running[size % len(s.running)])
        s.kv.pool.check_integrity()
    run_to_completion(s)
    s.kv.pool.check_integrity()
    assert s.kv.pool.all_free()


# -- speculative decoding (prompt lookup) ----------------------------------------------------
def cyclic_tick(s: Scheduler, period=5):
    """A fake greedy model: the token after t is (t + 1) % period, so outputs cycle and drafts can match."""
    plan = s.schedule()
    result = ModelRunnerOutput()
    for c in plan.chunks:
        if not c.sample:
            continue
        scored = c.token_ids[len(c.token_ids) - c.num_draft_tokens - 1:]
        greedy = [(t + 1) % period for t in scored]
        result.sampled_token_ids[c.request_id] = greedy[0]
        if c.num_draft_tokens:
            result.verified_token_ids[c.request_id] = greedy
    s.update(plan, result)
    return plan


def greedy_request(rid, max_tokens, prompt=(1, 2, 3, 4, 0, 1)):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def run_cyclic(s: Scheduler, requests, limit=1000):
    for r in requests:
        s.add_request(r)
    ticks = 0
    while s.has_work() and ticks < limit:
        cyclic_tick(s)
        ticks += 1
    return ticks


def test_speculation_yields_the_same_tokens_in_fewer_ticks():
    plain = [greedy_request(f"r{i}", 23 + i) for i in range(3)]
    fast = [greedy_request(f"r{i}", 23 + i) for i in range(3)]
    plain_ticks = run_cyclic(make(), plain)
    s = make(speculative_ngram=4)
    fast_ticks = run_cyclic(s, fast)
    assert [r.output_token_ids for r in fast] == [r.output_token_ids for r in plain]
    assert all(len(r.output_token_ids) == r.sampling_params.max_tokens for r in fast)  # never past max_tokens
    assert fast_ticks < plain_ticks / 2
    assert s.stats.num_accepted_tokens == s.stats.num_draft_tokens > 0  # a perfect fake model accepts all
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks
    s.kv.pool.check_integrity()


def test_rejected_drafts_back_off_and_cost_no_tokens():
    class WrongGuesses:
        calls = 0

        def propose(self, token_ids, num_tokens):
            self.calls += 1
            return [99] * num_tokens  # the cyclic model never says 99

    plain = greedy_request("r", 40)
    run_cyclic(make(), [plain])
    s = make(speculative_ngram=4)
    s.proposer = WrongGuesses()
    request = greedy_request("r", 40)
    run_cyclic(s, [request])
    assert request.output_token_ids == plain.output_token_ids
    assert s.stats.num_accepted_tokens == 0
    assert 0 < s.proposer.calls <= 6  # back-off: drafts on decode ticks 1, 3, 7, 15, 31 of 40
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_model_drafters_back_off_from_their_second_straight_miss():
    """n-gram lookups skip 1, 3, 7 ticks after 1, 2, 3 straight misses; a model drafter's lone miss costs no skip
    (a trained head's misses rarely come in runs), then 1, 3."""
    assert [_skip_ticks(n, model_draft=False) for n in range(4)] == [0, 1, 3, 7]
    assert [_skip_ticks(n, model_draft=True) for n in range(4)] == [0, 0, 1, 3]


def test_no_speculation_for_sampled_requests_or_large_batches():
    s = make(speculative_ngram=4, speculative_max_rows=3)
    sampled = Request("t", [1, 2, 3, 1, 2], SamplingParams(max_tokens=8, temperature=0.7, ignore_eos=True))
    run_cyclic(s, [sampled])
    assert s.stats.num_draft_tokens == 0
    run_cyclic(s, [greedy_request(f"g{i}", 12) for i in range(3)])  # 3 decode rows fill the 3 rows: no drafts
    assert s.stats.num_draft_tokens == 0
