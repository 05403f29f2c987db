"""Issue #40's three models in one server with room for two: the bundled SmolLM2-135M, the Gemma 3 270M
Q4_K_M file and a tiny random Qwen3; requests rotating over them and all at once answer bitwise as a
single-model server of each, while models load and unload underneath."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conveyor.config import EngineConfig, ModelsConfig, ServerConfig
from conveyor.loading import default_model_path, load_checkpoint
from conveyor.testing import GEMMA3_270M_INSTALL, gemma3_270m_path
from tests.server.conftest import serve
from tests.server.multimodel.conftest import serve_multi

ENGINE = EngineConfig(parallel=2, ctx_size=2048, kv_cache_budget="64M", max_queue_depth=64)
PROMPTS = ("The capital of France is", "def fibonacci(n):")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    from tests.loading.tiny_checkpoints import tiny_hf_model, write_gguf

    gemma = gemma3_270m_path()
    assert gemma is not None, f"the Gemma 3 270M packages are part of `make setup`: {GEMMA3_270M_INSTALL}"
    qwen3 = tmp_path_factory.mktemp("qwen3") / "tiny-qwen3.gguf"
    write_gguf(qwen3, "qwen3", tiny_hf_model("qwen3", tie=True))
    return {"smollm2": default_model_path(), "gemma3": gemma, "qwen3": str(qwen3)}


@pytest.fixture(scope="module")
def single(sources) -> dict[str, object]:
    """Each model's greedy completions and measured memory, from a single-model server of its own."""
    found = {}
    for key, path in sources.items():
        with serve(load_checkpoint(path), ENGINE) as served:
            replies = {p: _complete(served.url, served.model, p) for p in PROMPTS}
            found[key] = (replies, served.core.memory_report()["total"])
    return found


def _complete(url: str, model: str, prompt: str) -> str:
    reply = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 10,
                                                      "temperature": 0}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_three_real_models_with_a_budget_for_two_answer_as_single_model_servers(sources, single):
    sizes = sorted(size for _, size in single.values())
    budget = sizes[1] + sizes[2]  # the two largest fit together, never all three
    models = ModelsConfig(models=tuple(sources.values()), models_memory_budget=str(budget))
    with serve_multi(models, ServerConfig(metrics=True), ENGINE) as (url, multi):
        names = {key: next(e.name for e in multi.registry.entries.values() if e.spec.source == path)
                 for key, path in sources.items()}
        for _ in range(2):
            for key in sources:
                for prompt in PROMPTS:
                    assert _complete(url, names[key], prompt) == single[key][0][prompt], (key, prompt)
                assert multi.registry.used_bytes <= budget

        async def all_at_once() -> list[tuple[str, str, str]]:
            async with httpx.AsyncClient(timeout=300) as client:
                jobs = [(key, p) for key in sources for p in PROMPTS] * 2

                async def one(key: str, prompt: str) -> str:
                    reply = await client.post(f"{url}/v1/completions", json={
                        "model": names[key], "prompt": prompt, "max_tokens": 10, "temperature": 0})
                    assert reply.status_code == 200, reply.text
                    return reply.json()["choices"][0]["text"]

                texts = await asyncio.gather(*(one(k, p) for k, p in jobs))
                return [(k, p, t) for (k, p), t in zip(jobs, texts)]

        for key, prompt, text in asyncio.run(all_at_once()):
            assert text == single[key][0][prompt], (key, prompt)
        cards = httpx.get(f"{url}/v1/models").json()["data"]
        assert sum(c["unloads"].get("evicted", 0) for c in cards) >= 2
        metrics = httpx.get(f"{url}/metrics").text
        assert "conveyor_model_loads_total" in metrics and 'reason="evicted"' in metrics
        for entry in multi.registry.entries.values():
            if entry.app is not None:
                entry.app.state.engine.core.kv.check_integrity()

