"""The router knows which node serves which model, and routes by the request's `model`.

In-process first (no model): the pools choose among the nodes serving a model, the health probe
learns a node's models from the node, a decode node refuses another model's handoff and a prefill
node moves on to one of its own. Then real processes: two tiny random models (model-a, model-b),
each with its own prefill and decode node, behind one router holding both tokenizers; each model's
answers come from its own nodes only, byte for byte what its decode node answers alone."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from cluster_harness import free_port, metric_sample, start, wait_for, wait_healthy
from conveyor.cluster import transport, wire
from conveyor.cluster.decode import DecodeNode
from conveyor.cluster.health import HealthMonitor
from conveyor.cluster.models import ModelDispatch, RoutedModel
from conveyor.cluster.node import FrameServer
from conveyor.cluster.prefill import PrefillNode
from conveyor.cluster.registry import Registry
from conveyor.cluster.router import create_router_app
from conveyor.cluster.serve import load_tokenizer
from conveyor.config import ClusterConfig, ServerConfig
from conveyor.server.errors import APIError
from conveyor.server.limits import RequestLimits
from conveyor.testing import smollm_tokenizer, write_tiny_model_dir

CHAT = "/v1/chat/completions"


# -- in-process ----------------------------------------------------------------------------------------

def test_pools_pick_only_nodes_serving_the_model():
    registry = Registry(["p1:1", "p2:2", "p3:3"], ["d1:4", "d2:5"], default_model="a")
    prefill, decode = registry.pools()
    prefill.set_models(prefill.nodes[0], ["a"])
    prefill.set_models(prefill.nodes[1], ["b"])  # p3 has not said: it serves the default model, "a"
    decode.set_models(decode.nodes[1], ["b"])
    assert [prefill.pick(model="a").address for _ in range(3)] == ["p1:1", "p3:3", "p1:1"]
    assert [prefill.pick(model="b").address for _ in range(2)] == ["p2:2", "p2:2"]
    assert prefill.pick(model="c") is None and prefill.pick(exclude=[prefill.nodes[1]], model="b") is None
    prefill.mark_unreachable(prefill.nodes[1], "test")
    assert prefill.pick(model="b") is None and decode.pick(model="b").address == "d2:5"
    assert registry.models() == {"a": {"prefill": ["p1:1", "p3:3"], "decode": ["d1:4"]},
                                 "b": {"prefill": [], "decode": ["d2:5"]}}
    assert registry.view()["prefill"][1]["models"] == ["b"] and registry.view()["prefill"][2]["models"] is None


def test_the_health_probe_learns_each_nodes_models_from_the_node():
    async def go():
        node = FrameServer(f"127.0.0.1:{free_port()}", models=["model-b"])
        await node.start()
        try:
            registry = Registry([node.bind], [], default_model="model-a")
            await HealthMonitor(registry, interval=60.0, timeout=30.0).probe_all()
            return registry.prefill.nodes[0]
        finally:
            await node.stop()

    seen = asyncio.run(go())
    assert seen.online and seen.models == ("model-b",)


def _handoff(model: str) -> wire.HandoffFrame:
    return wire.HandoffFrame(request_id="r", prompt_token_ids=[1, 2], output_token_ids=[3],
                             sampling=wire.SamplingWire(max_tokens=4),
                             kv=wire.KVPayload(2, 2, 2, 16, "bfloat16", b"\x00"), model=model)


def test_a_prefill_node_hands_off_only_to_a_decode_node_of_its_model():
    """A decode node of another model refuses the handoff (wrong_model) and the prefill node goes on to
    the next of its targets; the fake decode node of the right model takes it."""
    async def go():
        engine = SimpleNamespace(core=None)
        other = DecodeNode(engine, ClusterConfig(node_role="decode", serving_bind=f"127.0.0.1:{free_port()}"),
                           models=["model-b"])
        await other.start()
        taken: list[wire.HandoffFrame] = []

        async def same_model(reader, writer):  # stands in for model-a's decode node
            taken.append(await transport.read_frame(reader))
            await transport.write_frame(writer, wire.TokenFrame(request_id="r", token_ids=[4], text="x",
                                                                finished=True, finish_reason="length"))
            writer.close()

        server = await asyncio.start_server(same_model, "127.0.0.1", 0)
        own = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        prefill = PrefillNode(engine, ClusterConfig(node_role="prefill", serving_bind="127.0.0.1:1"),
                              models=["model-a"])
        try:
            address, _, decode_writer, first = await prefill._open_decode(_handoff("model-a"), [other.bind, own])
            transport.close(decode_writer)
            reader, writer = await transport.connect(other.bind)  # and the refusal itself, as the wire carries it
            await transport.write_frame(writer, _handoff("model-a"))
            refusal = await transport.read_frame(reader)
            transport.close(writer)
        finally:
            server.close()
            await other.stop()
        return address == own, first, taken, refusal, other.stats, prefill.stats

    to_own, first, taken, refusal, other_stats, prefill_stats = asyncio.run(go())
    assert to_own and first.finished and [f.model for f in taken] == ["model-a"]
    assert (refusal.status, refusal.code, refusal.param) == (404, wire.WRONG_MODEL, "model")
    assert "serves model-b, not 'model-a'" in refusal.message
    assert other_stats.num_refused == 2 and other_stats.num_handoffs == 0
    assert prefill_stats.num_handoffs == 1 and prefill_stats.num_decode_failovers == 1


def test_which_model_a_name_picks():
    """One routed model (the `conveyor serve --node-role router` case): any name is answered by it, as a single
    node answers (agents send their own default name), except a model only other nodes serve, or under
    --strict-model-name. Several: a name none of them has is a 404."""
    tokenizer = smollm_tokenizer()
    registry = Registry(["p:1"], ["d:2"], default_model="a")
    registry.prefill.set_models(registry.prefill.nodes[0], ["b"])
    limits = RequestLimits.from_config(ServerConfig())

    def dispatch(models: list[RoutedModel], strict: bool = False) -> ModelDispatch:
        return ModelDispatch(models, {m.model_id: None for m in models}, registry, limits, None, strict)

    one = dispatch([RoutedModel(tokenizer, "a-checkpoint", "a")])
    assert [one.resolve(name) for name in (None, "a", "a-checkpoint", "gpt-4o")] == ["a"] * 4
    with pytest.raises(APIError, match="served by p:1, but this router holds no tokenizer") as refused:
        one.resolve("b")
    assert (refused.value.status, refused.value.code) == (404, "model_not_found")
    with pytest.raises(APIError, match="does not exist; this router serves: a"):
        dispatch([RoutedModel(tokenizer, "a")], strict=True).resolve("gpt-4o")
    two = dispatch([RoutedModel(tokenizer, "a"), RoutedModel(tokenizer, "c")])
    assert [two.resolve(name) for name in (None, "a", "c")] == ["a", "a", "c"]
    with pytest.raises(APIError, match="does not exist; this router serves: a, c"):
        two.resolve("gpt-4o")


def test_a_node_refuses_a_frame_for_another_model_and_any_model_without_one():
    node = FrameServer("127.0.0.1:1", models=["model-a"])
    assert node.serves("model-a") and node.serves(None) and not node.serves("model-b")
    assert FrameServer("127.0.0.1:1").serves("anything")  # a node that does not know its model checks nothing
    assert node.wrong_model("model-b").frame.code == wire.WRONG_MODEL


# -- real processes --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    paths = {name: write_tiny_model_dir(root / name, seed=seed) for seed, name in enumerate(("model-a", "model-b"))}
    logs = str(root)
    decode_a = start("decode-a", paths["model-a"], logs, "decode")
    decode_b = start("decode-b", paths["model-b"], logs, "decode")
    # model-a's prefill node lists model-b's decode node first: its handoffs must still land on decode-a.
    prefill_a = start("prefill-a", paths["model-a"], logs, "prefill",
                      ["--decode-peers", f"{decode_b.serving},{decode_a.serving}"])
    prefill_b = start("prefill-b", paths["model-b"], logs, "prefill", ["--decode-peers", decode_b.serving])
    procs = [decode_a, decode_b, prefill_a, prefill_b]
    try:
        wait_healthy(procs)
        (tok_a, name_a), (tok_b, name_b) = (load_tokenizer(paths[n]) for n in ("model-a", "model-b"))
        cluster = ClusterConfig(node_role="router", prefill_peers=f"{prefill_a.serving},{prefill_b.serving}",
                                decode_peers=f"{decode_a.serving},{decode_b.serving}", health_check_interval=0.5)
        app = create_router_app(tok_a, name_a, cluster, more_models=[RoutedModel(tok_b, name_b)])
        with TestClient(app) as router:  # its lifespan probes every node (and learns its model) first
            # (on a busy machine a node's answer may miss that first probe: the next ones bring it)
            wait_for(lambda: all(len(nodes["prefill"]) == 1 and len(nodes["decode"]) == 1
                                 for nodes in router.get("/router/stats").json()["models"].values())
                     and len(router.get("/router/stats").json()["models"]) == 2, 60,
                     "the router to learn every node's model")
            yield {"router": router, "decode-a": decode_a, "decode-b": decode_b, "prefill-a": prefill_a,
                   "prefill-b": prefill_b, "paths": paths, "logs": logs}
    finally:
        for proc in procs:
            proc.stop()


def _chat(model: str | None, content: str = "Name three colors.") -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "cache_prompt": False}
    return body if model is None else {"model": model, **body}


def _dispatched(router: TestClient) -> dict[str, int]:
    stats = router.get("/router/stats").json()
    return {n["address"]: n["dispatched"] for role in ("prefill", "decode") for n in stats[role]}


def _alone(proc, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{proc.url}{path}", json=body, timeout=60)


def test_each_model_is_answered_by_its_own_nodes_only(two_models):
    router = two_models["router"]
    for model, own, other in (("model-a", "a", "b"), ("model-b", "b", "a")):
        before = _dispatched(router)
        for i in range(3):  # more than one round of any rotation that ignored the model
            body = _chat(model, f"Name {i + 2} colors.")
            routed = router.post(CHAT, json=body)
            assert routed.status_code == 200, routed.text
            alone = _alone(two_models[f"decode-{own}"], CHAT, body).json()
            assert routed.json()["choices"] == alone["choices"] and routed.json()["model"] == model
        after = _dispatched(router)
        moved = {address for address in after if after[address] != before[address]}
        assert moved == {two_models[f"prefill-{own}"].serving, two_models[f"decode-{own}"].serving}
        assert not moved & {two_models[f"prefill-{other}"].serving, two_models[f"decode-{other}"].serving}
    texts = [router.post(CHAT, json=_chat(m)).json()["choices"][0]["message"]["content"]
             for m in ("model-a", "model-b")]
    assert texts[0] != texts[1]  # two models indeed (different weights, the same tokenizer)


def test_every_api_routes_by_model(two_models):
    """Completions and Anthropic Messages name their model the same way; a request that names none goes
    to the default (the first) model, as before."""
    router = two_models["router"]
    completion = {"model": "model-b", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    routed = router.post("/v1/completions", json=completion)
    assert routed.json()["choices"] == _alone(two_models["decode-b"], "/v1/completions", completion).json()["choices"]
    messages = {"model": "model-b", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "question for the agents"}]}
    routed = router.post("/v1/messages", json=messages)
    assert routed.status_code == 200, routed.text
    assert routed.json()["content"] == _alone(two_models["decode-b"], "/v1/messages", messages).json()["content"]
    unnamed = router.post(CHAT, json=_chat(None))
    assert unnamed.json()["choices"] == router.post(CHAT, json=_chat("model-a")).json()["choices"]


def test_a_model_no_node_serves_is_a_404_in_each_apis_shape(two_models):
    router = two_models["router"]
    before = _dispatched(router)
    refused = router.post(CHAT, json=_chat("no-such-model"))
    assert refused.status_code == 404
    error = refused.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "model_not_found", "model")
    assert "no-such-model" in error["message"] and "model-a, model-b" in error["message"]
    messages = router.post("/v1/messages", json={"model": "no-such-model", "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert messages.status_code == 404 and messages.json()["type"] == "error"  # Anthropic's shape
    assert router.get("/v1/models/no-such-model").status_code == 404
    assert _dispatched(router) == before  # nothing was sent anywhere


def test_models_lists_the_union_with_the_nodes_serving_each(two_models):
    router = two_models["router"]
    listed = router.get("/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["model-a", "model-b"]
    for card in listed:
        own = card["id"][-1]
        assert card["nodes"] == {"prefill": [two_models[f"prefill-{own}"].serving],
                                 "decode": [two_models[f"decode-{own}"].serving]}
    assert router.get("/v1/models/model-b").json() == listed[1]
    health = router.get("/health").json()
    assert health["models"] == {"model-a": {"prefill_online": 1, "decode_online": 1},
                                "model-b": {"prefill_online": 1, "decode_online": 1}}
    stats = router.get("/router/stats").json()
    nodes = {n["address"]: n["models"] for role in ("prefill", "decode") for n in stats[role]}
    assert nodes[two_models["decode-b"].serving] == ["model-b"]


def test_metrics_and_the_dashboard_are_per_model(two_models):
    """The router's own series carry the model; the dashboard (and its stream) and a GET's ?model= pick one."""
    router = two_models["router"]
    series = [("conveyor_router_requests_finished_total", {"model": m, "finish_reason": "length"})
              for m in ("model-a", "model-b")]
    series += [("conveyor_router_time_to_first_token_seconds_count", {"model": m}) for m in ("model-a", "model-b")]
    before = [metric_sample(router, name, **labels) for name, labels in series]
    dash_before = {m: router.get("/v1/dashboard", params={"model": m}).json() for m in ("model-a", "model-b")}
    for _ in range(2):
        assert router.post(CHAT, json=_chat("model-b")).status_code == 200
    after = [metric_sample(router, name, **labels) for name, labels in series]
    assert [a - b for a, b in zip(after, before)] == [0, 2, 0, 2]
    assert metric_sample(router, "conveyor_router_model_nodes_online", model="model-b", role="decode") == 1
    dash = {m: router.get("/v1/dashboard", params={"model": m}).json() for m in ("model-a", "model-b")}
    assert dash["model-b"]["model"] == "model-b" and router.get("/v1/dashboard").json()["model"] == "model-a"
    assert dash["model-b"]["counters"]["ttft_count"] - dash_before["model-b"]["counters"]["ttft_count"] == 2
    assert dash["model-a"]["counters"]["ttft_count"] == dash_before["model-a"]["counters"]["ttft_count"]
    assert router.get("/v1/dashboard", params={"model": "nope"}).status_code == 404
    assert router.get("/v1/dashboard/stream", params={"model": "nope"}).status_code == 404
    # a GET names its model with ?model= (the tokenizer routes are per model)
    assert router.get("/tokenize", params={"model": "nope"}).status_code == 404


def _completed(proc) -> int:
    return httpx.get(f"{proc.url}/health", timeout=5).json()["batch"]["total_completed"]


def test_a_prefill_node_skips_a_decode_peer_of_another_model(two_models):
    """Sent to model-a's prefill node with no decode_target, a request goes round its --decode-peers, the
    first of which serves model-b: that one refuses, and model-a's decode node continues it."""
    async def one(i: int) -> list[wire.TokenFrame]:
        reader, writer = await transport.connect(two_models["prefill-a"].serving)
        await transport.write_frame(writer, wire.GenerateFrame(
            request_id=f"direct-{i}", prompt_token_ids=[1, 2, 3, 4], model="model-a",
            sampling=wire.SamplingWire(max_tokens=6, temperature=0.0, ignore_eos=True)))
        frames = [await transport.read_frame(reader)]
        while not frames[-1].finished:
            frames.append(await transport.read_frame(reader))
        transport.close(writer)
        return frames

    async def go():
        return [await one(i) for i in range(2)]  # one after the other: the round robin starts at each peer

    before = {name: _completed(two_models[name]) for name in ("decode-a", "decode-b")}
    streams = asyncio.run(go())
    for frames in streams:
        assert frames[-1].finish_reason == "length" and frames[-1].error is None
        assert sum(len(f.token_ids) for f in frames) == 6
    assert _completed(two_models["decode-a"]) == before["decode-a"] + 2
    assert _completed(two_models["decode-b"]) == before["decode-b"]
    wrong = asyncio.run(_generate_for(two_models["prefill-b"].serving, "model-a"))
    assert isinstance(wrong, wire.ErrorFrame) and wrong.code == wire.WRONG_MODEL


async def _generate_for(address: str, model: str) -> wire.Frame:
    reader, writer = await transport.connect(address)
    try:
        await transport.write_frame(writer, wire.GenerateFrame(request_id="wrong", prompt_token_ids=[1, 2],
                                                               sampling=wire.SamplingWire(max_tokens=2), model=model))
        return await transport.read_frame(reader)
    finally:
        transport.close(writer)


def test_the_router_process_takes_several_models_from_the_command_line(two_models):
    """`conveyor serve --node-role router --model A --model B ...`: both routed, each to its own nodes."""
    nodes = two_models
    peers = ["--prefill-peers", f"{nodes['prefill-a'].serving},{nodes['prefill-b'].serving}",
             "--decode-peers", f"{nodes['decode-a'].serving},{nodes['decode-b'].serving}"]
    router = start("router-cli", nodes["paths"]["model-a"], nodes["logs"], "router",
                   ["--model", nodes["paths"]["model-b"], *peers], serving=False)
    try:
        wait_healthy([router])
        listed = httpx.get(f"{router.url}/v1/models", timeout=30).json()["data"]
        assert sorted(m["id"] for m in listed) == ["model-a", "model-b"]
        for model in ("model-a", "model-b"):
            reply = httpx.post(f"{router.url}/v1/chat/completions", json=_chat(model), timeout=120)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == \
                _alone(nodes[f"decode-{model[-1]}"], "/v1/chat/completions", _chat(model)).json()["choices"][0][
                    "message"]["content"]
    finally:
        router.stop()


def test_a_slow_connect_takes_a_node_out_only_after_several_probes_a_refused_one_at_once(monkeypatch):
    """On a busy machine a connect can time out while the node is fine: one timeout is not a dead node."""
    from conveyor.cluster import health

    async def slow(address, timeout):
        raise asyncio.TimeoutError

    async def go():
        registry = Registry(["127.0.0.1:1"], [], default_model="a")
        node = registry.prefill.nodes[0]
        monitor = HealthMonitor(registry, interval=60.0, timeout=0.1)
        monkeypatch.setattr(health.transport, "connect", slow)
        seen = []
        for _ in range(health.PROBE_TIMEOUTS_TO_UNREACHABLE):
            await monitor.probe_all()
            seen.append(node.online)
        monkeypatch.undo()  # the real connect: nothing listens on port 1, refused
        refused = Registry(["127.0.0.1:1"], [], default_model="a")
        await HealthMonitor(refused, interval=60.0, timeout=5.0).probe_all()
        return seen, refused.prefill.nodes[0].online

    seen, refused_online = asyncio.run(go())
    assert seen == [True] * (len(seen) - 1) + [False] and not refused_online
