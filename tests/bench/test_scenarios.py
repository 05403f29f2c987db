import asyncio

from conveyor.bench.client import Target, make_client
from conveyor.bench.scenarios import long_prompt_admission
from conveyor.bench.workload import PromptSource, Workload


def _admission(url, max_tokens=60):
    workload = Workload(PromptSource(num_tokens=8, seed=0), max_tokens=max_tokens, ignore_eos=True)

    async def go():
        async with make_client(None, 10.0, 8) as client:
            return await long_prompt_admission(client, Target(url, "chat", "fake-model"), workload,
                                               num_streams=3, long_prompt_tokens=200)
    return asyncio.run(go())


def test_prefill_stall_shows_in_window_itl(fake_server):
    # The fake "prefills" prompts of >= 100 words for 150 ms and stalls every stream meanwhile.
    fake_server.state.chunk_delay_s = 0.005
    fake_server.state.long_prompt_words, fake_server.state.prefill_s = 100, 0.15
    result = _admission(fake_server.url)
    assert result.passed, result.errors
    assert result.long_ttft_ms >= 150
    assert result.num_window_gaps >= 3  # at least the stalled gap of each stream
    assert result.window_itl_ms.p95 >= 100  # the stall
    assert result.overall_itl_ms.p50 < result.window_itl_ms.p95  # ordinary gaps are shorter than the stall
    assert "Long-prompt admission" in result.to_markdown()


def test_streams_that_end_early_are_flagged(fake_server):
    fake_server.state.long_prompt_words, fake_server.state.prefill_s = 100, 0.1
    result = _admission(fake_server.url, max_tokens=1)
    assert result.num_window_gaps == 0
    assert "warning" in result.to_markdown()
