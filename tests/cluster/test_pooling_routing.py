"""Embeddings, rerank and score through the router: forwarded over HTTP to a node serving the named model.

In-process first: the health probe learns where a node's HTTP API listens (a wildcard host is dialed at the
node's serving host), and which node and model a pooling request picks. Then real processes: a tiny chat
model on a prefill and a decode node, and a tiny embedder on a node of its own, behind one router (with an
API key): its embeddings are the node's own bytes, a rerank to the embedder is the node's own 400, a model
no node serves is a 404, /metrics and the dashboard count what was forwarded, and a node that fails costs
one retry (502 when no other node is left, then 503 while it is down)."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager

import httpx
import msgspec
import pytest
from fastapi.testclient import TestClient

from cluster_harness import free_port, metric_sample, start, wait_for, wait_healthy
from conveyor.cluster import wire
from conveyor.cluster.forward import PoolingForwarder
from conveyor.cluster.health import HealthMonitor
from conveyor.cluster.models import ModelDispatch, RoutedModel
from conveyor.cluster.node import FrameServer
from conveyor.cluster.registry import Registry
from conveyor.cluster.router import create_router_app
from conveyor.cluster.serve import load_tokenizer
from conveyor.cluster.transport import join_address, reachable_address
from conveyor.config import ClusterConfig, ServerConfig
from conveyor.server.errors import APIError
from conveyor.server.limits import RequestLimits
from conveyor.testing import smollm_tokenizer, write_tiny_model_dir
from tests.pooling_models import write_qwen3_embedder

KEY = "router-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EMBEDDER = "tiny-embedder"
TEXTS = ["the quick brown fox", "a second, longer text about vectors"]


# -- in-process ----------------------------------------------------------------------------------------

def test_node_info_carries_the_http_address_and_a_wildcard_host_is_dialed_at_the_serving_host():
    frame = wire.NodeInfoFrame(role="prefill", models=["m"], http_address="0.0.0.0:8080")
    assert wire.decode(wire.encode(frame)[wire.HEADER.size:]) == frame
    older = msgspec.msgpack.encode({"type": "node_info", "role": "decode", "models": ["m"]})
    assert wire.decode(older).http_address is None  # a node that does not say: nothing is forwarded to it
    assert reachable_address("0.0.0.0:8080", "10.0.0.7:9000") == "10.0.0.7:8080"
    assert reachable_address("[::]:8080", "[fd00::1]:9000") == "[fd00::1]:8080"
    assert reachable_address("10.0.0.8:8080", "10.0.0.7:9000") == "10.0.0.8:8080"
    assert join_address("::1", 80) == "[::1]:80" and join_address("node-3", 80) == "node-3:80"

    async def probe():
        node = FrameServer(f"127.0.0.1:{free_port()}", models=[EMBEDDER], http_address="0.0.0.0:8123")
        await node.start()
        try:
            registry = Registry([node.bind], [], default_model="chat")
            await HealthMonitor(registry, interval=60.0, timeout=30.0).probe_all()
            return registry
        finally:
            await node.stop()

    registry = asyncio.run(probe())
    assert registry.prefill.nodes[0].http_address == "127.0.0.1:8123"
    assert registry.view()["prefill"][0]["http_address"] == "127.0.0.1:8123"


def _forwarder(models: list[str], strict: bool = True) -> PoolingForwarder:
    registry = Registry(["p1:1", "p2:2"], ["d1:3"], default_model=models[0])
    for node in (*registry.prefill.nodes, *registry.decode.nodes):
        pool = registry.prefill if node.role == "prefill" else registry.decode
        pool.set_models(node, [EMBEDDER])
        pool.set_http_address(node, f"0.0.0.0:8{node.address[-1]}")
    routed = [RoutedModel(smollm_tokenizer(), f"{m}-checkpoint", m) for m in models]
    limits = RequestLimits.from_config(ServerConfig())
    dispatch = ModelDispatch(routed, {m: None for m in models}, registry, limits, None, strict)
    return PoolingForwarder(dispatch, limits, metrics=None)


def test_a_pooling_request_goes_to_the_least_busy_prefill_node_of_its_model_else_a_decode_node():
    forwarder = _forwarder(["chat"])
    p1, p2 = forwarder.registry.prefill.nodes
    d1 = forwarder.registry.decode.nodes[0]
    assert (p1.http_address, d1.http_address) == ("p1:81", "d1:83")
    assert forwarder.pick(EMBEDDER) is p1  # a tie: the first
    p1.num_in_flight = 1
    assert forwarder.pick(EMBEDDER) is p2
    p2.num_in_flight, p2.num_dispatched = 1, 5
    assert forwarder.pick(EMBEDDER) is p1  # as busy now, and sent fewer
    assert forwarder.pick(EMBEDDER, exclude=[p1]) is p2  # a prefill node first, however busy
    assert forwarder.pick(EMBEDDER, exclude=[p1, p2]) is d1
    forwarder.registry.prefill.mark_unreachable(p1, "test")
    p2.http_address = None  # a node that did not say where its HTTP API is
    assert forwarder.pick(EMBEDDER) is d1
    assert forwarder.pick("chat") is None  # no node serves it


def test_which_model_a_pooling_request_is_for():
    """As for chats (models.py), except that a model only nodes serve is theirs: no tokenizer is needed."""
    strict = _forwarder(["chat"])
    assert [strict.resolve(name) for name in (None, "chat", "chat-checkpoint", EMBEDDER)] == \
        ["chat", "chat", "chat", EMBEDDER]
    with pytest.raises(APIError, match=f"'gpt-4o' does not exist; this router serves: chat, {EMBEDDER}") as refused:
        strict.resolve("gpt-4o")
    assert (refused.value.status, refused.value.code, refused.value.param) == (404, "model_not_found", "model")
    assert _forwarder(["chat"], strict=False).resolve("gpt-4o") == "chat"  # one routed model, as a node answers
    with pytest.raises(APIError, match="does not exist"):
        _forwarder(["chat", "other"], strict=False).resolve("gpt-4o")


# -- real processes --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooling")
    chat_path = write_tiny_model_dir(root / "chat-model")
    logs = str(root)
    decode = start("decode-chat", chat_path, logs, "decode")
    prefill = start("prefill-chat", chat_path, logs, "prefill", ["--decode-peers", decode.serving])
    embedder = start("embedder", write_qwen3_embedder(root / EMBEDDER), logs, "prefill")
    procs = [decode, prefill, embedder]
    try:
        wait_healthy(procs)
        tokenizer, name = load_tokenizer(chat_path)
        peers = ClusterConfig(node_role="router", prefill_peers=f"{prefill.serving},{embedder.serving}",
                              decode_peers=decode.serving, health_check_interval=0.5)
        app = create_router_app(tokenizer, name, peers, ServerConfig(api_key=KEY, strict_model_name=True))
        with TestClient(app, headers=AUTH) as router:
            # each node's models come with a probe's answer; on a busy machine the first may come late
            wait_for(lambda: set(router.get("/router/stats").json()["models"]) >= {name, EMBEDDER}, 60,
                     "the router to learn every node's models")
            yield {"router": router, "chat": name, "decode": decode, "prefill": prefill, "embedder": embedder,
                   "chat_path": chat_path}
    finally:
        for proc in procs:
            proc.stop()


def _direct(proc, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{proc.url}{path}", json=body, timeout=60)


def _dispatched(router: TestClient) -> dict[str, int]:
    stats = router.get("/router/stats").json()
    return {n["address"]: n["dispatched"] for role in ("prefill", "decode") for n in stats[role]}


def test_embeddings_through_the_router_are_the_nodes_own_bytes(cluster):
    router, embedder = cluster["router"], cluster["embedder"]
    before = _dispatched(router)
    for path, body in (("/v1/embeddings", {"model": EMBEDDER, "input": TEXTS}),
                       ("/v1/embeddings", {"model": EMBEDDER, "input": TEXTS[0], "encoding_format": "base64",
                                           "dimensions": 16}),
                       ("/embedding", {"model": EMBEDDER, "content": TEXTS})):  # llama-server's shape
        routed = router.post(path, json=body)
        assert routed.status_code == 200, routed.text
        direct = _direct(embedder, path, body)
        assert routed.content == direct.content and routed.headers["content-type"] == direct.headers["content-type"]
    after = _dispatched(router)
    assert {a for a in after if after[a] != before[a]} == {embedder.serving}
    assert after[embedder.serving] == before[embedder.serving] + 3


def test_a_rerank_to_the_embedder_is_the_nodes_own_400(cluster):
    router, embedder = cluster["router"], cluster["embedder"]
    for path, body in (("/v1/rerank", {"model": EMBEDDER, "query": "q", "documents": ["a", "b"]}),
                       ("/v1/score", {"model": EMBEDDER, "text_1": "q", "text_2": ["a"]})):
        routed = router.post(path, json=body)
        assert routed.status_code == 400
        assert routed.content == _direct(embedder, path, body).content
        assert "serves /v1/embeddings" in routed.json()["error"]["message"]


def test_pooling_routes_by_model_and_a_model_no_node_serves_is_a_404(cluster):
    router, chat = cluster["router"], cluster["chat"]
    before = _dispatched(router)
    refused = router.post("/v1/embeddings", json={"model": "no-such-model", "input": "x"})
    assert refused.status_code == 404
    error = refused.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "model_not_found", "model")
    assert f"this router serves: {chat}, {EMBEDDER}" in error["message"]
    assert router.post("/v1/embeddings", json={"model": EMBEDDER, "input": "x"}, headers={"Authorization": ""}
                       ).status_code == 401  # the router's key, before anything is read or sent
    assert _dispatched(router) == before  # nothing was sent anywhere
    to_chat = router.post("/v1/embeddings", json={"model": chat, "input": "x"})  # the chat node's own refusal
    assert to_chat.status_code == 400 and "generates text" in to_chat.json()["error"]["message"]
    assert to_chat.content == _direct(cluster["prefill"], "/v1/embeddings", {"model": chat, "input": "x"}).content
    listed = {m["id"]: m for m in router.get("/v1/models").json()["data"]}
    assert set(listed) == {chat, EMBEDDER} and listed[EMBEDDER]["routed"] == "pooling only"
    assert listed[EMBEDDER]["nodes"]["prefill"] == [cluster["embedder"].serving]
    assert router.get(f"/v1/models/{EMBEDDER}").json()["id"] == EMBEDDER
    assert router.get("/v1/models/no-such-model").status_code == 404
    reply = router.post("/v1/chat/completions", json={"model": chat, "max_tokens": 4, "temperature": 0,
                                                      "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200, reply.text  # chats still go over the wire to the prefill/decode pair


def test_metrics_and_the_dashboard_count_forwarded_requests_per_endpoint(cluster):
    router = cluster["router"]
    series = [("conveyor_router_forwarded_requests_total", {"endpoint": "/v1/embeddings", "status": "200"}),
              ("conveyor_router_forwarded_requests_total", {"endpoint": "/v1/rerank", "status": "400"}),
              ("conveyor_api_requests_total", {"api": "embeddings"}),
              ("conveyor_api_requests_total", {"api": "rerank"}),
              ("conveyor_router_forwarded_total", {})]
    before = [metric_sample(router, name, **labels) for name, labels in series]
    routing = router.get("/v1/dashboard").json()["routing"]
    for _ in range(2):
        assert router.post("/v1/embeddings", json={"model": EMBEDDER, "input": TEXTS}).status_code == 200
    assert router.post("/v1/rerank", json={"model": EMBEDDER, "query": "q", "documents": ["d"]}).status_code == 400
    assert router.post("/v1/embeddings", json={"model": "no-such-model", "input": "x"}).status_code == 404
    after = [metric_sample(router, name, **labels) for name, labels in series]
    assert [a - b for a, b in zip(after, before)] == [2, 1, 3, 1, 3]  # the 404 was received, not forwarded
    now = router.get("/v1/dashboard").json()["routing"]
    assert (now["forwarded"] - routing["forwarded"], now["completed"] - routing["completed"],
            now["failed"] - routing["failed"]) == (3, 2, 1)


@contextmanager
def _fake_node(models: list[str], http_address: str | None):
    """A frame server (in a thread of its own) that tells the router it serves `models` over HTTP at an address
    where nothing listens: every request forwarded to it fails."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    node = FrameServer(f"127.0.0.1:{free_port()}", models=models, http_address=http_address)
    asyncio.run_coroutine_threadsafe(node.start(), loop).result(10)
    try:
        yield node
    finally:
        asyncio.run_coroutine_threadsafe(node.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@contextmanager
def _router(cluster, prefill_peers: list[str]):
    tokenizer, name = load_tokenizer(cluster["chat_path"])
    peers = ClusterConfig(node_role="router", prefill_peers=",".join(prefill_peers),
                          decode_peers=cluster["decode"].serving, health_check_interval=60.0)
    app = create_router_app(tokenizer, name, peers)
    with TestClient(app) as router:
        # The monitor's first round of its own follows the lifespan's at once: past it, nothing marks the
        # failed node online again during the test.
        wait_for(lambda: app.state.monitor.num_rounds >= 2, 10, "the monitor's first round")
        yield router


def test_a_node_that_fails_costs_one_retry_then_502_then_503(cluster):
    body = {"model": EMBEDDER, "input": TEXTS}
    with _fake_node([EMBEDDER], f"127.0.0.1:{free_port()}") as dead:
        with _router(cluster, [dead.bind, cluster["embedder"].serving]) as router:  # the dead node is tried first
            routed = router.post("/v1/embeddings", json=body)
            assert routed.status_code == 200, routed.text
            assert routed.content == _direct(cluster["embedder"], "/v1/embeddings", body).content
            stats = router.get("/router/stats").json()
            seen = {n["address"]: n for n in stats["prefill"]}[dead.bind]
            assert seen["status"] == "unreachable" and "forward" in seen["last_error"]
            assert stats["routing"]["retries"] == 1 and stats["routing"]["completed"] == 1
        with _router(cluster, [dead.bind]) as router:  # no other node of the model
            failed = router.post("/v1/embeddings", json=body)
            assert failed.status_code == 502, failed.text
            error = failed.json()["error"]
            assert error["code"] == "node_failed" and dead.http_address in error["message"]
            down = router.post("/v1/embeddings", json=body)  # the failed node is out until a probe answers
            assert down.status_code == 503 and down.json()["error"]["code"] == "no_node"
            assert down.headers["retry-after"] == "1"
