import asyncio

import pytest

from conveyor.config import EngineConfig
from conveyor.engine.async_engine import AsyncEngine, QueueFullError
from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_from_config_builds_on_its_thread_and_streams(tiny_checkpoint):
    want = LLM(checkpoint=tiny_checkpoint).generate(["hello async"], GREEDY)[0]
    engine = AsyncEngine.from_config(EngineConfig(parallel=2), tiny_checkpoint)

    async def go():
        engine.start(asyncio.get_running_loop())
        request = engine.core.make_request(engine.core.tokenizer.encode("hello async"), GREEDY)
        return [out async for out in engine.generate(request)]

    try:
        outs = asyncio.run(go())
    finally:
        engine.shutdown()
    assert [t for o in outs for t in o.new_token_ids] == want.token_ids
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert engine.core.pool.all_free()


def test_from_config_reports_build_errors(tiny_checkpoint):
    with pytest.raises(ValueError, match="tokens per slot"):
        AsyncEngine.from_config(EngineConfig(parallel=8, ctx_size=1024), tiny_checkpoint)


def test_queue_depth_is_enforced(tiny_checkpoint):
    engine = AsyncEngine.from_config(EngineConfig(parallel=1, max_queue_depth=2), tiny_checkpoint)

    async def go():
        # Not started: nothing drains, so the third submission finds the queue full.
        engine._loop = asyncio.get_running_loop()
        for i in range(2):
            engine.submit(engine.core.make_request([1, 2, 3], GREEDY))
        with pytest.raises(QueueFullError):
            engine.submit(engine.core.make_request([1, 2, 3], GREEDY))

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()


def test_a_quiet_load_uses_one_thread_and_gives_the_engine_thread_its_count_back(tiny_checkpoint):
    """A multi-model server loads with load_threads=1 while other models stream; the engine then steps with
    the thread count it would have had (torch's per-thread setting, read on the engine thread)."""
    import torch

    from conveyor.engine.load_progress import LoadProgress

    seen = {}

    class Watch(LoadProgress):
        def set_stage(self, stage: str) -> None:
            seen.setdefault(stage, torch.get_num_threads())
            super().set_stage(stage)

    expected = torch.get_num_threads()
    engine = AsyncEngine.from_config(EngineConfig(parallel=2), tiny_checkpoint, progress=Watch(), load_threads=1)

    async def threads_when_stepping() -> int:
        engine.start(asyncio.get_running_loop())
        return await engine.call(lambda core: torch.get_num_threads())

    try:
        assert seen["weights"] == 1 and engine.core.config.threads == 0
        assert asyncio.run(threads_when_stepping()) == expected
    finally:
        engine.shutdown()


def test_suspend_frees_the_model_and_resume_goes_on_bitwise(tiny_checkpoint):
    """A multi-model server's preemption: streams stay open while the model is freed, then every request goes
    on where it stopped (re-prefilled) with the tokens it would have had; one sent meanwhile runs after."""
    import gc
    import weakref

    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, stop=["zz"])]
    prompts = ["suspend me", "a seeded one", "short"]
    llm = LLM(checkpoint=tiny_checkpoint)
    want = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    engine = AsyncEngine.from_config(EngineConfig(parallel=4), tiny_checkpoint)

    async def go():
        engine.start(asyncio.get_running_loop())
        core = engine.core
        requests = [core.make_request(core.tokenizer.encode(p), sp) for p, sp in zip(prompts, params)]
        streams = [engine.submit(r) for r in requests[:2]]
        got = [[], []]
        for stream, tokens in zip(streams, got):  # a few tokens each before the model goes
            while len(tokens) < 3:
                tokens += (await stream.get()).new_token_ids
        runner = weakref.ref(core.runner)
        await engine.suspend()
        gc.collect()
        assert engine.suspended and runner() is None, "the suspended model's runner is still alive"
        streams.append(engine.submit(requests[2]))  # queued while suspended
        got.append([])
        await asyncio.to_thread(engine.resume, checkpoint=tiny_checkpoint)
        texts = ["", "", ""]
        for i, stream in enumerate(streams):
            while True:
                out = await stream.get()
                got[i] += out.new_token_ids
                if out.finished:
                    assert out.finish_reason == "length", out
                    break
        engine.core.kv.check_integrity()
        return got

    try:
        got = asyncio.run(go())
    finally:
        engine.shutdown()
    assert got == [w.token_ids for w in want]
