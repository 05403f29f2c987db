import asyncio

from conveyor.bench.client import Target, make_client
from conveyor.bench.runner import run_level, run_sweep
from conveyor.bench.workload import PromptSource, Workload


def _sweep(url, levels, num_requests, endpoint="chat", **kwargs):
    workload = Workload(PromptSource(num_tokens=16, seed=0), max_tokens=8, ignore_eos=True)

    async def go():
        async with make_client(None, 10.0, max(levels)) as client:
            return await run_sweep(client, Target(url, endpoint, "fake-model"), workload, levels, num_requests,
                                   progress=False, **kwargs)
    return asyncio.run(go())


def test_levels_count_tokens_without_errors(fake_server):
    levels = _sweep(fake_server.url, [1, 4], num_requests=8, endpoint="completions")
    assert [s.concurrency for s in levels] == [1, 4]
    for s in levels:
        assert s.num_requests == 8 and s.num_errors == 0
        assert s.num_output_tokens == 64
        assert s.output_tok_s > 0 and s.ttft_ms.p50 > 0 and s.itl_ms.p50 > 0
    assert fake_server.state.num_requests == 16
    assert fake_server.state.max_in_flight == 4
    prompts = [b["messages"][0]["content"] if "messages" in b else b["prompt"] for b in fake_server.state.bodies]
    assert len(set(prompts)) == 16  # fresh prompts per level


def test_errors_counted_and_run_continues(fake_server):
    fake_server.state.fail_every = 3
    (level,) = _sweep(fake_server.url, [4], num_requests=12)
    assert level.num_errors == 4
    assert level.num_output_tokens == 8 * 8
    assert level.error_samples and "503" in level.error_samples[0]


def test_warmup_is_not_measured(fake_server):
    (level,) = _sweep(fake_server.url, [2], num_requests=4, num_warmup=3)
    assert fake_server.state.num_requests == 7 and level.num_requests == 4


def test_poisson_sends_every_request(fake_server):
    (level,) = _sweep(fake_server.url, [8], num_requests=20, request_rate=400.0, seed=3)
    assert fake_server.state.num_requests == 20
    assert level.num_requests == 20 and level.num_errors == 0 and level.request_rate == 400.0
    assert fake_server.state.max_in_flight <= 8


def test_poisson_arrivals_take_about_n_over_rate(fake_server):
    fake_server.state.chunk_delay_s = 0.0
    workload = Workload(PromptSource(4, 0), max_tokens=1)

    async def go():
        async with make_client(None, 10.0, 64) as client:
            return await run_level(client, Target(fake_server.url, "chat", "m"), workload.specs(30, 0), 64,
                                   request_rate=100.0, seed=0, progress=False)
    result = asyncio.run(go())
    assert len(result.records) == 30
    assert result.wall_s > 0.1  # 29 gaps of mean 10 ms: arrivals were paced, not sent at once
