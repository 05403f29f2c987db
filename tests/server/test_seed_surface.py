"""The seeds' serving surface over HTTP: --no-batch serves one request at a time; the speculation state."""

from __future__ import annotations

import asyncio

import httpx

from conveyor.config import EngineConfig


def test_no_batch_serves_one_request_at_a_time(serve_tiny):
    with serve_tiny(EngineConfig(no_batch=True, parallel=4, ctx_size=2048)) as served:
        props = httpx.get(f"{served.url}/props").json()
        assert props["total_slots"] == 1 and props["default_generation_settings"]["n_ctx"] == 2048

        async def burst():
            client = served.async_client()
            return await asyncio.gather(*(client.completions.create(
                model=served.model, prompt=f"request {i}", max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True}) for i in range(3)))

        replies = asyncio.run(burst())
        assert all(r.usage.completion_tokens == 6 for r in replies)
        assert set(served.core.counters.batch_size_counts) == {1}  # never two rows in one forward
        assert served.core.scheduler.stats.num_completed == 3


def test_speculation_state_on_props_and_the_policy_endpoint(served):
    props = httpx.get(f"{served.url}/props").json()
    for path in ("/v1/internal/spec-policy", "/v1/internal/mtp-policy"):
        body = httpx.get(f"{served.url}{path}").json()
        assert body == props["speculation"]
    assert body["draft_model"]["enabled"] is False and body["policy"] is None
    assert body["prompt_lookup"]["enabled"] == served.core.kernel_report()["speculation"]
