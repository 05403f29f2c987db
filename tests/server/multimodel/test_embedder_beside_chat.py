"""An embedding model and a chat model in one server: they take turns on the cores (engine/compute_share.py),
and neither's output changes: streamed chats and embeddings made at the same time are bitwise what a
single-model server of each gives."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from conveyor.config import ConfigError, ModelsConfig
from conveyor.loading import load_checkpoint
from conveyor.testing import write_tiny_model_dir

from tests.pooling_models import write_qwen3_embedder
from tests.server.conftest import serve
from tests.server.multimodel.conftest import ENGINE, serve_multi

PROMPTS = ("Tell me about the sea", "One two three", "Why is the sky blue?", "Count to ten")
TEXTS = [f"text number {i} about {'retrieval ' * (i % 7)}and vectors" for i in range(24)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    folder = tmp_path_factory.mktemp("share")
    return write_tiny_model_dir(folder / "chat"), write_qwen3_embedder(folder / "embedder")


async def _stream(client: openai.AsyncOpenAI, prompt: str) -> str:
    stream = await client.chat.completions.create(model="chat", messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=24, temperature=0, stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def _embed(client: openai.AsyncOpenAI, texts: list[str]) -> list[list[float]]:
    reply = await client.embeddings.create(model="embedder", input=texts, encoding_format="float")
    return [d.embedding for d in reply.data]


def test_chats_and_embeddings_at_once_match_single_model_servers(models):
    chat_dir, embedder_dir = models
    with serve(load_checkpoint(chat_dir), ENGINE) as single:
        client = single.client()
        expected_chats = [client.chat.completions.create(model="chat", messages=[{"role": "user", "content": p}],
                                                         max_tokens=24, temperature=0).choices[0].message.content
                          for p in PROMPTS]
    with serve(load_checkpoint(embedder_dir), ENGINE) as single:
        expected_vectors = [d.embedding for d in single.client().embeddings.create(
            model="embedder", input=TEXTS, encoding_format="float").data]

    with serve_multi(ModelsConfig(models=(chat_dir, embedder_dir))) as (url, multi):
        share = multi.registry.compute_share
        assert share is not None and share.background_share == 0.33

        async def both() -> tuple[list[str], list[list[list[float]]]]:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            await _embed(client, TEXTS[:1])  # both models loaded before the race
            await _stream(client, PROMPTS[0])
            chats = [_stream(client, p) for p in PROMPTS]
            batches = [_embed(client, TEXTS[i:i + 6]) for i in range(0, len(TEXTS), 6)]
            results = await asyncio.gather(*chats, *batches)
            return results[:len(chats)], results[len(chats):]

        chats, batches = asyncio.run(both())
        assert chats == expected_chats
        assert [v for batch in batches for v in batch] == expected_vectors
        assert share.stats.foreground_steps > 0 and share.stats.background_slices > 0
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert "conveyor_compute_share_background_slices_total" in metrics
        for entry in multi.registry.entries.values():
            core = entry.app.state.engine.core
            core.kv.check_integrity()
            assert core.pool.stats().num_used == 0


def test_a_share_of_1_turns_the_turns_off(models):
    with serve_multi(ModelsConfig(models=models, models_background_share=1.0)) as (_, multi):
        assert multi.registry.compute_share is None


@pytest.mark.parametrize("share", [0.0, -1.0, 1.5])
def test_a_share_outside_0_to_1_is_a_config_error(share):
    with pytest.raises(ConfigError, match="models_background_share"):
        ModelsConfig(models_background_share=share)
