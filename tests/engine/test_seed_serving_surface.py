"""The seeds' scheduler and memory surface: --no-batch, --parallel -1, --max-kv-size, the prompt-cache
budget, and several prompts prefilled in one tick while rows decode."""

import pytest

from conveyor.engine.block_pool import BlockPool
from conveyor.engine.engine import EngineCore
from conveyor.engine.kv_cache_manager import KVCacheManager
from conveyor.engine.llm import LLM
from conveyor.engine.memory import plan_kv_pool
from conveyor.engine.outputs import ModelRunnerOutput
from conveyor.engine.request import Request
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.scheduler import Scheduler
from conveyor.engine.scheduling_policy import SchedulerConfig
from conveyor.config import EngineConfig

BLOCK = 4


def _scheduler(num_blocks=512, **config) -> Scheduler:
    config.setdefault("max_model_len", 4096)
    return Scheduler(SchedulerConfig(**config), KVCacheManager(BlockPool(num_blocks, False), BLOCK))


def _request(rid, prompt_len, max_tokens=8):
    return Request(rid, [(i * 7 + len(rid)) % 50 for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _tick(s: Scheduler):
    plan = s.schedule()
    s.update(plan, ModelRunnerOutput(sampled_token_ids={c.request_id: 3 for c in plan.chunks if c.sample}))
    return plan


def test_waiting_prompts_are_prefilled_together_while_rows_decode():
    s = _scheduler(max_batch_size=16)  # adaptive chunk: 512 while decoding, derived cap 2*4*512
    s.add_request(_request("live", 8, max_tokens=1000))
    _tick(s)
    burst = [_request(f"burst{i}", 500, max_tokens=1) for i in range(8)]
    for r in burst:
        s.add_request(r)
    plan = _tick(s)
    sizes = sorted(len(c.token_ids) for c in plan.chunks)
    assert sizes == [500] * 4  # four whole prompts in one forward (was: one, plus 12 tokens of the next)
    assert all(r.output_token_ids for r in burst[:4]) and not any(r.output_token_ids for r in burst[4:])
    plan = _tick(s)  # the next four
    assert sorted(len(c.token_ids) for c in plan.chunks) == [500] * 4


def test_a_prompt_longer_than_a_chunk_is_admitted_last_and_parks_alone():
    s = _scheduler(max_batch_size=16, max_batch_prefill_tokens=0)
    s.add_request(_request("live", 8, max_tokens=1000))
    _tick(s)
    for rid, length in (("short", 100), ("long", 1500), ("after", 100)):
        s.add_request(_request(rid, length, max_tokens=1))
    plan = _tick(s)
    assert [(c.request_id, len(c.token_ids)) for c in plan.chunks] == [("short", 100), ("long", 512)]
    parked = [r for r in s.running if r.num_tokens - r.num_computed_tokens > 1]
    assert [r.request_id for r in parked] == ["long"]
    for _ in range(200):
        if "after" not in s.requests:
            break
        _tick(s)
    assert "after" not in s.requests  # the one behind the parked prompt got its turn
    s.kv.pool.check_integrity()


def test_max_kv_size_caps_the_pool_and_the_window():
    plan = plan_kv_pool(model_max_len=8192, ctx_size=0, num_slots=4, kv_unified=False, block_size=16,
                        bytes_per_block=1000, budget=None, weight_bytes=0, max_kv_tokens=4096)
    assert (plan.max_model_len, plan.num_blocks) == (4096, 256)
    with pytest.raises(ValueError, match="max-kv-size"):
        plan_kv_pool(model_max_len=8192, ctx_size=0, num_slots=4, kv_unified=False, block_size=16,
                     bytes_per_block=1000, budget=None, weight_bytes=0, max_kv_tokens=100)


def test_prompt_cache_budget_bounds_cold_prefixes():
    pool = BlockPool(16, enable_caching=True, max_cached_free=3)
    blocks = pool.allocate(6)
    for i, block in enumerate(blocks):
        pool.cache_block(block, hash(("p", i)), (i,))
    pool.free(blocks)
    assert pool.num_cached_free_blocks == 3
    # The tail goes first (freed first) so the prefix heads stay, as under LRU.
    assert all(pool.lookup(hash(("p", i)), (i,)) is not None for i in range(3))
    assert pool.lookup(hash(("p", 5)), (5,)) is None
    pool.check_integrity()


def test_prompt_cache_budget_in_the_engine(tiny_checkpoint):
    llm = LLM(checkpoint=tiny_checkpoint, parallel=2, prompt_cache_budget="16K")
    per_block = llm.engine.pool_plan.bytes_per_block
    assert llm.engine.pool.max_cached_free == 16 * 1024 // per_block
    params = SamplingParams(temperature=0, max_tokens=4)
    llm.generate([f"prompt {i} " + "word " * 80 for i in range(4)], params)
    assert llm.engine.pool.num_cached_free_blocks <= llm.engine.pool.max_cached_free
    llm.engine.pool.check_integrity()


def test_no_batch_runs_one_request_at_a_time_with_the_whole_context(tiny_checkpoint):
    core = EngineCore(EngineConfig(no_batch=True, parallel=8, ctx_size=2048), checkpoint=tiny_checkpoint)
    assert core.max_batch_size == 1 and core.max_model_len == 2048  # not 2048 / 8
    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer = core, core.tokenizer
    outs = llm.generate([f"request {i}" for i in range(3)], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert all(len(o.token_ids) == 5 for o in outs)
    assert set(core.counters.batch_size_counts) == {1}


def test_parallel_auto_is_four_slots_sharing_one_window(tiny_checkpoint):
    core = EngineCore(EngineConfig(parallel=-1, ctx_size=2048), checkpoint=tiny_checkpoint)
    assert core.max_batch_size == 4
    assert core.max_model_len == 2048  # unified: each slot may use the whole window
    assert core.pool_plan.num_blocks * core.config.block_size == 2048  # ... out of one shared budget
    split = EngineCore(EngineConfig(parallel=-1, ctx_size=2048, no_kv_unified=True), checkpoint=tiny_checkpoint)
    assert split.max_model_len == 512
