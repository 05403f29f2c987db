"""A real multi-model server over three tiny random models with room for two: every request answered by the
model it names, bitwise as a single-model server answers it, while models load and unload underneath."""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import subprocess
import sys
import threading
import time
import weakref

import anthropic
import httpx
import openai
import pytest

from conveyor.config import ModelsConfig, ServerConfig
from conveyor.loading import load_checkpoint
from conveyor.server.multimodel.registry import ModelState
from conveyor.testing import write_tiny_model_dir

from tests.cluster.cluster_harness import start, wait_healthy
from tests.server.conftest import serve  # a single-model server on a free port
from tests.server.multimodel.conftest import ENGINE, serve_multi

NAMES = ("m0", "m1", "m2")
PROMPTS = ("Tell me about the sea", "One two three", "Why is the sky blue?")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("models")
    for seed, name in enumerate(NAMES):
        write_tiny_model_dir(folder / name, seed=seed)
    return str(folder)


@pytest.fixture(scope="module")
def reference(models_dir) -> dict[tuple[str, str], str]:
    """Each model's greedy reply to each prompt from a single-model server of its own."""
    replies = {}
    for name in NAMES:
        with serve(load_checkpoint(f"{models_dir}/{name}"), ENGINE) as single:
            client = single.client()
            for prompt in PROMPTS:
                replies[name, prompt] = _chat(client, name, prompt)
    return replies


def _chat(client: openai.OpenAI, model: str, prompt: str) -> str:
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=12, temperature=0)
    assert reply.model == model
    return reply.choices[0].message.content


async def _stream(client: openai.AsyncOpenAI, model: str, prompt: str) -> str:
    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=12, temperature=0, stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


def _check_integrity(multi) -> None:
    for entry in multi.registry.entries.values():
        if entry.state is ModelState.LOADED:
            core = entry.app.state.engine.core
            core.kv.check_integrity()
            assert core.pool.stats().num_used == 0, f"{entry.name} holds blocks while idle"


def test_requests_rotating_over_three_models_with_room_for_two_match_single_model_servers(models_dir, reference):
    with serve_multi(ModelsConfig(models_dir=models_dir, models_max=2)) as (url, multi):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        for round_ in range(2):  # one model at a time, rotating: every switch past two unloads one
            for name in NAMES:
                assert _chat(client, name, PROMPTS[round_]) == reference[name, PROMPTS[round_]]

        async def concurrent() -> list[tuple[str, str, str]]:
            aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            jobs = [(name, prompt) for prompt in PROMPTS for name in NAMES] * 2
            replies = await asyncio.gather(*(_stream(aclient, name, prompt) for name, prompt in jobs))
            return [(name, prompt, reply) for (name, prompt), reply in zip(jobs, replies)]

        for name, prompt, reply in asyncio.run(concurrent()):  # all three wanted at once, two fit
            assert reply == reference[name, prompt], (name, prompt)

        cards = {c["id"]: c for c in httpx.get(f"{url}/v1/models").json()["data"]}
        assert sum(c["status"]["value"] == "loaded" for c in cards.values()) <= 2
        assert sum(c["unloads"].get("evicted", 0) for c in cards.values()) >= 3
        assert all(c["loads"] >= 2 for c in cards.values())
        loaded = [c for c in cards.values() if c["status"]["value"] == "loaded"]
        assert all(c["memory_bytes"]["total"] == sum(v for k, v in c["memory_bytes"].items() if k != "total")
                   and c["memory_bytes"]["weights"] > 0 for c in loaded)
        metrics = httpx.get(f"{url}/metrics").text
        assert 'conveyor_model_unloads_total{model="m0",reason="evicted"}' in metrics
        assert 'conveyor_requests_finished_total{finish_reason="length",model="' in metrics  # a model's own series
        _check_integrity(multi)


def test_memory_budget_for_two_models_rotates_with_the_same_outputs(models_dir, reference):
    with serve_multi(ModelsConfig(models_dir=models_dir)) as (url, multi):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert _chat(client, "m0", PROMPTS[0]) == reference["m0", PROMPTS[0]]
        one = multi.registry.entries["m0"].memory["total"]
    # room for two measured models, not three
    with serve_multi(ModelsConfig(models_dir=models_dir, models_memory_budget=str(int(2.5 * one)))) as (url, multi):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        for name in NAMES * 2:
            assert _chat(client, name, PROMPTS[1]) == reference[name, PROMPTS[1]]
            assert multi.registry.used_bytes <= 2.5 * one
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok" and health["memory"]["budget_bytes"] == int(2.5 * one)
        assert sum(m["status"] == "loaded" for m in health["models"].values()) == 2
        _check_integrity(multi)


def test_every_api_routes_by_model_and_errors_keep_their_api_shape(models_dir, reference):
    with serve_multi(ModelsConfig(models_dir=models_dir, models_max=3)) as (url, multi):
        messages = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        reply = messages.messages.create(model="m1", max_tokens=12, extra_body={"temperature": 0},
                                         messages=[{"role": "user", "content": PROMPTS[2]}])
        assert reply.model == "m1" and reply.content[0].text == reference["m1", PROMPTS[2]]
        with pytest.raises(anthropic.NotFoundError) as missing:
            messages.messages.create(model="claude-opus", max_tokens=4, messages=[{"role": "user", "content": "x"}])
        assert missing.value.body["error"]["type"] == "not_found_error"

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        first = client.responses.create(model="m2", input=PROMPTS[0], max_output_tokens=12, temperature=0)
        assert first.output_text == reference["m2", PROMPTS[0]]
        # the store is shared: a conversation may continue on another model, and GET finds it from the front
        follow = client.responses.create(model="m0", input="And then?", previous_response_id=first.id,
                                         max_output_tokens=4, temperature=0)
        assert follow.model == "m0" and client.responses.retrieve(first.id).id == first.id

        with pytest.raises(openai.NotFoundError, match="this server serves: m0, m1, m2"):
            client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "x"}])
        # no model named: a POST goes to the first model listed
        body = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 4}).json()
        assert body["model"] == "m0"
        # GET routes of one model: ?model=, else the most recently used
        assert httpx.get(f"{url}/props", params={"model": "m1"}).json()["model_alias"] == "m1"
        assert httpx.get(f"{url}/v1/models/m2").json()["status"]["value"] == "loaded"
        assert httpx.get(f"{url}/v1/models/nope").status_code == 404
        _check_integrity(multi)


def test_each_model_has_a_base_url_of_its_own_that_answers_as_a_single_model_server(models_dir, reference):
    """/model/<name>/...: what a gateway that learns one model per worker URL (SMG) is given."""
    with serve_multi(ModelsConfig(models_dir=models_dir, models_max=2)) as (url, multi):
        base = f"{url}/model/m2"
        assert httpx.get(f"{base}/health").json() == {"status": "ok", "model": "m2", "state": "unloaded"}
        listed = httpx.get(f"{base}/v1/models").json()["data"]
        assert [card["id"] for card in listed] == ["m2"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        assert _chat(client, "m2", PROMPTS[1]) == reference["m2", PROMPTS[1]]
        # the path decides: a body without a model, or naming this one, runs here; another model is a 400
        plain = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 4}).json()
        assert plain["model"] == "m2"
        wrong = httpx.post(f"{base}/v1/chat/completions",
                           json={"model": "m0", "messages": [{"role": "user", "content": "x"}]})
        assert wrong.status_code == 400 and "/model/m0/" in wrong.json()["error"]["message"]
        assert httpx.get(f"{base}/props").json()["model_alias"] == "m2"  # a GET of its state, loaded now
        assert httpx.get(f"{url}/model/m1/props").json()["error"]["code"] == "model_not_loaded"
        missing = httpx.get(f"{url}/model/nope/v1/models")
        assert missing.status_code == 404 and "m0, m1, m2" in missing.json()["error"]["message"]
        _check_integrity(multi)


def test_load_and_unload_by_request_and_without_autoload(models_dir):
    with serve_multi(ModelsConfig(models_dir=models_dir, models_autoload=False)) as (url, multi):
        chat = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        refused = httpx.post(f"{url}/v1/chat/completions", json=chat)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "model_not_loaded"
        assert httpx.post(f"{url}/models/load", json={"model": "m1"}, timeout=60).json()["status"] == "loaded"
        assert httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
        # a page watching m1's dashboard neither holds it nor blocks its unload; its stream ends with the model
        with httpx.stream("GET", f"{url}/v1/dashboard/stream", params={"model": "m1"}, timeout=60) as watch:
            lines = watch.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert multi.registry.entries["m1"].num_active == 0
            assert httpx.post(f"{url}/models/unload", json={"model": "m1"}, timeout=60).json()["status"] == "unloaded"
            for _ in lines:  # ends (the model's engine stopped), rather than hanging until the timeout
                pass
        refused = httpx.get(f"{url}/props", params={"model": "m1"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "model_not_loaded"
        assert multi.registry.entries["m1"].unloads["requested"] == 1
        assert httpx.post(f"{url}/models/load", json={"model": "nope"}).status_code == 404
        assert httpx.post(f"{url}/models/load", json={}).status_code == 400


def test_the_api_key_is_checked_before_a_model_loads(models_dir):
    server = ServerConfig(api_key="secret", metrics=True)
    with serve_multi(ModelsConfig(models_dir=models_dir), server) as (url, multi):
        chat = {"model": "m2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/chat/completions", json=chat).status_code == 401
        assert httpx.get(f"{url}/v1/models").status_code == 401
        # and under a model's own base URL
        assert httpx.post(f"{url}/model/m2/v1/chat/completions", json=chat).status_code == 401
        assert httpx.get(f"{url}/model/m2/v1/models").status_code == 401
        assert httpx.get(f"{url}/model/m2/health").status_code == 200
        assert multi.registry.entries["m2"].num_loads == 0
        ok = httpx.post(f"{url}/v1/chat/completions", json=chat, headers={"x-api-key": "secret"}, timeout=60)
        assert ok.status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200  # health stays open


def test_conveyor_serve_with_model_given_twice_serves_both_and_exits_0_on_sigterm(models_dir, reference, tmp_path):
    """The real entry point: `conveyor serve --model A --model B`, each answered by name, then a clean stop."""
    proc = start("multi", None, str(tmp_path), extra=["--parallel", "2", "--kv-cache-budget", "8M", "--model",
                                                      f"{models_dir}/m0", "-m", f"{models_dir}/m2", "--metrics"])
    try:
        wait_healthy([proc], timeout=120)
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list()] == ["m0", "m2"]
        assert client.models.retrieve("m2").id == "m2"  # the SDK's GET /v1/models/{id}
        for name in ("m2", "m0"):
            assert _chat(client, name, PROMPTS[0]) == reference[name, PROMPTS[0]]
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(timeout=60) == 0
    finally:
        proc.stop()
    assert "ModelsConfig" in (tmp_path / "multi.log").read_text()  # the effective config was logged


def test_conveyor_serve_refuses_a_bad_preset_with_exit_2(tmp_path):
    preset = tmp_path / "models.ini"
    preset.write_text("[chat]\nparallel = 2\n")
    done = subprocess.run([sys.executable, "-m", "conveyor.cli", "serve", "--models-preset", str(preset)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "[chat]: no `model = PATH or ORG/NAME` line" in done.stderr


def test_an_unloaded_model_gives_its_memory_back(models_dir):
    """Nothing keeps an unloaded model's engine alive (FastAPI's endpoint caches did: ~0.7 GB a switch on a 1B)."""
    with serve_multi(ModelsConfig(models_dir=models_dir, models_max=1)) as (url, multi):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        _chat(client, "m0", PROMPTS[0])
        core = weakref.ref(multi.registry.entries["m0"].app.state.engine.core)
        _chat(client, "m1", PROMPTS[0])  # m0 is unloaded to make room
        assert multi.registry.entries["m0"].state is ModelState.UNLOADED
        gc.collect()
        assert core() is None, "the unloaded model's EngineCore is still referenced"


def test_preempt_parks_a_streaming_request_which_goes_on_bitwise_when_its_model_returns(models_dir):
    """--models-contention preempt with room for one: m0 streams; a request for m1 suspends m0 (its stream
    stays open), m1 answers, then m0 comes back and its stream ends with the tokens of an undisturbed run."""
    body = {"prompt": "Count with me:", "max_tokens": 600, "temperature": 0, "ignore_eos": True}
    with serve(load_checkpoint(f"{models_dir}/m0"), ENGINE) as single:
        want = httpx.post(f"{single.url}/v1/completions", json={**body, "model": "m0"}, timeout=120).json()
    with serve_multi(ModelsConfig(models_dir=models_dir, models_max=1, models_contention="preempt")) as (url, multi):
        streamed: list[str] = []
        started, finished = threading.Event(), threading.Event()

        def read() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "model": "m0", "stream": True},
                              timeout=120) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: {"):
                        streamed.append(json.loads(line[6:])["choices"][0]["text"])
                        started.set()
            finished.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert started.wait(60)
        other = httpx.post(f"{url}/v1/completions", json={"model": "m1", "prompt": "hi", "max_tokens": 4},
                           timeout=120)
        assert other.status_code == 200
        assert multi.registry.entries["m0"].unloads["preempted"] == 1
        assert finished.wait(120)
        assert "".join(streamed) == want["choices"][0]["text"]
        assert multi.registry.entries["m0"].state is ModelState.LOADED  # came back for its parked request
        assert multi.registry.contention_outcomes[("m1", "preempted")] == 1
        _check_integrity(multi)


def test_bad_bodies_are_answered_without_loading_a_model(models_dir):
    with serve_multi(ModelsConfig(models_dir=models_dir), ServerConfig(max_request_bytes=4096)) as (url, multi):
        cases = [(b"{not json", 400, "not valid JSON"), (b"[1, 2]", 400, "must be a JSON object"),
                 (b'{"model": 7, "prompt": "x"}', 400, "model must be a string"),
                 (b'{"prompt": "' + b"x" * 5000 + b'"}', 413, "")]
        for body, status, words in cases:
            reply = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"})
            assert reply.status_code == status and words in reply.text, (body[:20], reply.text)
        reply = httpx.post(f"{url}/v1/messages", content=b"{oops", headers={"content-type": "application/json"})
        assert reply.status_code == 400 and reply.json()["type"] == "error"  # Anthropic's shape there
        assert all(e.num_loads == 0 for e in multi.registry.entries.values())


def test_quick_fuzz_of_the_front_no_5xx_and_nothing_leaks(models_dir):
    """conveyor/fuzz.py's CI profile through the multi-model front: bodies from the request schemas (their
    `model` absent, random, or a served name) and mutations; no 5xx, every error in its API's shape."""
    from conveyor.fuzz import QUICK_EXAMPLES, run_fuzz

    with serve_multi(ModelsConfig(models_dir=models_dir, models_max=2)) as (url, multi):
        report = run_fuzz(url, QUICK_EXAMPLES // 3, seed=1)  # the bodies are the single-model fuzz's; this one is the dispatch
        assert not report.failures, "\n".join(report.failures[:10])
        assert report.statuses[200] >= 1 and sum(n for s, n in report.statuses.items() if 400 <= s < 500) >= 10
        for entry in multi.registry.entries.values():
            if entry.state is ModelState.LOADED:
                core = entry.app.state.engine.core
                deadline = time.monotonic() + 60
                while core.has_work():
                    assert time.monotonic() < deadline, "engine never went idle"
                    time.sleep(0.02)
                core.kv.check_integrity()
                assert core.pool.stats().num_used == 0


def test_the_catalog_s_tokenizers_are_read_at_start_and_a_load_takes_the_one_read(models_dir):
    """Building a tokenizer holds the GIL (loading/tokenizer_cache.py): read ahead, a load beside streaming models
    does not build one."""
    from conveyor.loading.tokenizer_cache import TOKENIZERS

    with serve_multi(ModelsConfig(models_dir=models_dir, models_autoload=False)) as (url, multi):
        multi.front.state.tokenizer_prefetch.join(timeout=60)
        assert len(TOKENIZERS) == len(NAMES)  # read ahead, none loaded
        assert httpx.post(f"{url}/models/load", json={"model": "m1"}, timeout=60).json()["status"] == "loaded"
        assert len(TOKENIZERS) == len(NAMES)
        assert multi.registry.entry("m1").app.state.engine.core.tokenizer is _tokenizer_of(models_dir, "m1")
    assert not TOKENIZERS.enabled and len(TOKENIZERS) == 0  # the server's cache goes with it


def test_a_gguf_s_header_is_read_at_start_and_its_load_parses_nothing(tmp_path, monkeypatch):
    """Parsing a GGUF header is ~0.1 s of Python and a gc pass beside the streams (loading/gguf_header.py): read
    ahead with the tokenizers, a load only maps the file."""
    import gguf

    from conveyor.loading import gguf_header
    from conveyor.testing import write_tiny_gguf

    def parsed_again(*args, **kwargs):
        raise AssertionError("the header was parsed again")

    (tmp_path / "models").mkdir()
    write_tiny_gguf(tmp_path / "models" / "g0.gguf", gguf.GGMLQuantizationType.Q8_0)
    with serve_multi(ModelsConfig(models_dir=str(tmp_path / "models"), models_autoload=False)) as (url, multi):
        multi.front.state.tokenizer_prefetch.join(timeout=60)
        assert len(gguf_header.HEADERS) == 1
        monkeypatch.setattr(gguf_header._Reader, "__init__", parsed_again)
        assert httpx.post(f"{url}/models/load", json={"model": "g0"}, timeout=60).json()["status"] == "loaded"
        reply = httpx.post(f"{url}/v1/completions", json={"model": "g0", "prompt": "Hi", "max_tokens": 4,
                                                          "temperature": 0}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    assert not gguf_header.HEADERS.enabled and len(gguf_header.HEADERS) == 0


def _tokenizer_of(models_dir: str, name: str):
    from conveyor.loading.hf_loader import read_hf_dir_tokenizer
    from conveyor.loading.tokenizer_cache import TOKENIZERS

    assert TOKENIZERS.enabled
    return read_hf_dir_tokenizer(f"{models_dir}/{name}")
