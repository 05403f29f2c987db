import asyncio

from conveyor.bench.client import Target, make_client
from conveyor.bench.consistency import check_consistency
from conveyor.bench.workload import PromptSource, Workload


def _check(url, concurrency=4, num_prompts=8):
    workload = Workload(PromptSource(num_tokens=8, seed=0), max_tokens=6, temperature=0.7)

    async def go():
        async with make_client(None, 10.0, concurrency) as client:
            return await check_consistency(client, Target(url, "completions", "fake-model"), workload,
                                           num_prompts, concurrency, progress=False)
    return asyncio.run(go())


def test_deterministic_server_passes(fake_server):
    result = _check(fake_server.url)
    assert result.passed and result.num_identical == 8 and not result.mismatches
    assert all(b["temperature"] == 0.0 for b in fake_server.state.bodies)  # forced greedy
    assert "PASS" in result.to_markdown()


def test_batch_dependent_output_is_caught(fake_server):
    fake_server.state.nondeterministic = True
    result = _check(fake_server.url)
    assert not result.passed
    assert result.mismatches and result.num_identical + len(result.mismatches) == 8
    first = result.mismatches[0]
    assert first.single != first.batched
    assert "FAIL" in result.to_markdown()


def test_errors_fail_the_check(fake_server):
    fake_server.state.fail_every = 5
    result = _check(fake_server.url)
    assert not result.passed and result.num_errors >= 1
