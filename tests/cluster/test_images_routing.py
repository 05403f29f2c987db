"""Image requests through the cluster, on the tiny random Gemma 3 (tests/multimodal/tiny_gemma3_vision.py).

In-process engines first: a handoff of an image sequence carries its expanded prompt, each image's span, hash and
tower rows, and no pixels; the decode node continues it bitwise, imported or re-prefilled from the carried rows,
without ever running its tower. Then a prefill node, a decode node and a router on loopback (in this process,
each with its own engine): chat, streamed, n=2, Messages' image blocks and 8 concurrent image requests through
the router answer as the decode node's own HTTP API (a single node) answers; bad images are the same 400s; no
KV block is left on either node."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import anthropic
import httpx
import msgspec
import openai
import pytest
import torch
import uvicorn

from cluster_harness import free_port
from conveyor.cluster import wire
from conveyor.cluster.decode import DecodeNode
from conveyor.cluster.images import images_from_wire, images_to_wire, spans_from_wire
from conveyor.cluster.prefill import PrefillNode, handoff_frame
from conveyor.cluster.router import create_router_app
from conveyor.cluster.serve import attach_node, load_tokenizer
from conveyor.config import ClusterConfig, EngineConfig, ServerConfig
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.engine import EngineCore
from conveyor.engine.kv_transfer import KVBlob
from conveyor.engine.sampling_params import SamplingParams
from conveyor.multimodal.image_input import ImageInput
from conveyor.server import create_app
from conveyor.server.lifecycle import GracefulServer
from tests.multimodal.image_files import animated_gif, data_url, encoded, picture, png
from tests.multimodal.tiny_gemma3_vision import NUM_EMBEDS, write_model_dir

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.batch_invariant, pytest.mark.timeout(240)]

MAX_TOKENS = 6
SIZES = [(40 + 8 * seed, 30) for seed in range(4)]
URLS = [data_url(png(seed, size)) for seed, size in enumerate(SIZES)]
CHAT = "/v1/chat/completions"


def _engine_config(model_dir: str, **kw) -> EngineConfig:
    return EngineConfig(model=model_dir, parallel=4, block_size=8, speculative_ngram=0, **kw)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_cluster")
    write_model_dir(path, transformers)
    return str(path)


# -- the handoff, in-process ------------------------------------------------------------------------------

def _prompt(core: EngineCore, num_images: int) -> list[int]:
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": "What is it?"}]
    text = core.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return core.tokenizer.encode(text, add_special_tokens=False)


def _run(core: EngineCore) -> None:
    while core.has_work():
        core.step()


def _handoff(core: EngineCore, request_id: str, images: list[int]) -> wire.HandoffFrame:
    """Prefill on `core` until the first token and hand off; the frame through the wire's own bytes."""
    inputs = [ImageInput.from_pil(picture(i, SIZES[i])) for i in images]
    request = core.make_request(_prompt(core, len(images)), SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                ignore_eos=True), request_id, images=inputs)
    core.kv_transfer.mark_for_handoff(request_id)
    core.add_request(request)
    handoff = None
    while handoff is None:
        handoff = next((o.kv_handoff for o in core.step() if o.kv_handoff is not None), None)
    frame = wire.decode(wire.encode(handoff_frame(handoff, None))[wire.HEADER.size:])
    assert isinstance(frame, wire.HandoffFrame)
    return frame


def _alone(core: EngineCore, images: list[int]) -> list[int]:
    inputs = [ImageInput.from_pil(picture(i, SIZES[i])) for i in images]
    request = core.make_request(_prompt(core, len(images)), SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                ignore_eos=True), images=inputs)
    core.add_request(request)
    _run(core)
    return request.output_token_ids


def test_a_handoff_carries_spans_and_tower_rows_and_never_pixels(model_dir):
    prefill = EngineCore(_engine_config(model_dir))
    decode = EngineCore(_engine_config(model_dir))
    node = DecodeNode(SimpleNamespace(core=decode), ClusterConfig(node_role="decode", serving_bind="127.0.0.1:1"))
    reference = EngineCore(_engine_config(model_dir, enable_prefix_caching=False))
    assert node.image_marker == "<start_of_image>"

    async def take(frame: wire.HandoffFrame, recompute: bool):
        blob = KVBlob(**{name: getattr(frame.kv, name) for name in frame.kv.__struct_fields__})
        request = await node._request(frame, blob)
        if recompute:  # as when no block is free at arrival: queued, and re-prefilled here from the carried rows
            decode.kv_transfer.forget(request.request_id)
        decode.add_request(request)
        _run(decode)
        return request

    for name, images, recompute in [("one", [0], False), ("two", [1, 2], False), ("again", [3, 1], True)]:
        frame = _handoff(prefill, name, images)
        row_bytes = NUM_EMBEDS * 64 * prefill.dtype.itemsize  # (the tiny text tower is 64 wide)
        assert len(frame.images) == len(images) and all(len(s.rows) == row_bytes for s in frame.images)
        sent = prefill.scheduler.requests.get(name)
        request = asyncio.run(take(frame, recompute))
        assert request.key_spans == [(s.offset, s.offset + s.num_tokens, bytes.fromhex(s.content_hash))
                                     for s in frame.images]
        assert request.output_token_ids == _alone(reference, images), name
        assert all(item.pixel_values is None and item.embeds is not None for item in request.images)
        assert sent is None  # the prefill engine let go of it
    assert decode.runner.encoder_cache.num_encoded == 0  # the decode engine never ran its tower
    assert decode.kv_transfer.stats.num_imported == 2 and decode.kv_transfer.stats.num_recomputed == 0
    for core in (prefill, decode):
        core.kv.check_integrity()
        assert core.pool.stats().num_used == 0


def test_malformed_image_frames_are_refused():
    with pytest.raises(ValueError, match="not 4 x 2 RGB"):
        images_from_wire([wire.ImageWire(width=4, height=2, rgb=bytes(23))])
    good = images_to_wire([ImageInput.from_pil(picture(0, (5, 3)))])
    assert images_from_wire(good)[0].content_hash == ImageInput.from_pil(picture(0, (5, 3))).content_hash
    span = wire.ImageSpanWire(content_hash="ab" * 16, offset=2, num_tokens=6, embed_runs=[(1, 4)], rows=bytes(4 * 8 * 2),
                              dtype="bfloat16", hidden=8)
    assert spans_from_wire([span], 10, 8, torch.bfloat16, "cpu")[0].embeds.shape == (4, 8)
    for bad, match in [(dict(offset=6), "not inside the prompt"), (dict(embed_runs=[(3, 4)]), "embed runs"),
                       (dict(rows=bytes(10)), "bytes of rows"), (dict(hidden=16), "do not match"),
                       (dict(content_hash="zz"), "not hex")]:
        with pytest.raises(ValueError, match=match):
            spans_from_wire([msgspec.structs.replace(span, **bad)], 10, 8, torch.bfloat16, "cpu")


# -- prefill node, decode node and router on loopback ----------------------------------------------------------

@contextmanager
def _serve(app, lifecycle=None, port: int = 0):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
    server = GracefulServer(config, lifecycle) if lifecycle is not None else uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


SERVER = dict(max_images=3, max_image_bytes=60_000, max_image_pixels=20_000)


@contextmanager
def _node(model_dir: str, role: str, decode_bind: str | None = None):
    engine = AsyncEngine(EngineCore(_engine_config(model_dir)))
    app = create_app(engine, ServerConfig(**SERVER))
    bind = f"127.0.0.1:{free_port()}"
    cluster = ClusterConfig(node_role=role, serving_bind=bind, decode_peers=decode_bind)
    kind = PrefillNode if role == "prefill" else DecodeNode
    port = free_port()  # said to the router (NodeInfoFrame.http_address): it asks a node to count image tokens
    attach_node(app, kind(engine, cluster, models=[app.state.serving.model_id], http_address=f"127.0.0.1:{port}"))
    with _serve(app, app.state.lifecycle, port) as url:
        yield SimpleNamespace(url=url, bind=bind, core=engine.core, engine=engine)


@pytest.fixture(scope="module")
def cluster(model_dir):
    with _node(model_dir, "decode") as decode, _node(model_dir, "prefill", None) as prefill:
        tokenizer, name = load_tokenizer(model_dir)
        config = ClusterConfig(node_role="router", prefill_peers=prefill.bind, decode_peers=decode.bind,
                               health_check_interval=0.25)
        with _serve(create_router_app(tokenizer, name, config, ServerConfig(**SERVER))) as router:
            yield SimpleNamespace(router=router, single=decode.url, prefill=prefill, decode=decode, model=name)


def _image(i: int) -> dict:
    return {"type": "image_url", "image_url": {"url": URLS[i]}}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _post(base: str, body: dict, path: str = CHAT) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120)


def _events(sse: str) -> list:
    events = [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: {")]
    for event in events:
        event.pop("id", None), event.pop("created", None)
    return events


def _same(a: dict, b: dict) -> None:
    for data in (a, b):
        data.pop("id", None), data.pop("created", None)
    assert a == b


def _clean(cluster) -> None:
    for node in (cluster.prefill, cluster.decode):
        deadline = time.monotonic() + 30
        while node.core.has_work() or node.core.pool.stats().num_used:
            assert time.monotonic() < deadline, "a node kept work or blocks"
            time.sleep(0.05)
        node.core.kv.check_integrity()


def test_image_chats_through_the_router_answer_as_a_single_node(cluster):
    bodies = [
        {"messages": [{"role": "user", "content": [_text("Look:"), _image(0), _text("and"), _image(1)]}]},
        {"messages": [{"role": "user", "content": [_image(2), _text("First?")]}, {"role": "assistant", "content": "ok"},
                      {"role": "user", "content": [_text("Then"), _image(3)]}], "n": 2},
        {"messages": [{"role": "user", "content": [_image(1), _text("Stream?")]}], "stream": True,
         "stream_options": {"include_usage": True}},
    ]
    for body in bodies:
        body.update(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, cache_prompt=False)
        single, routed = _post(cluster.single, body), _post(cluster.router, body)
        assert single.status_code == routed.status_code == 200, routed.text
        if body.get("stream"):
            assert _events(single.text) == _events(routed.text)
        else:
            _same(single.json(), routed.json())
    assert cluster.prefill.core.runner.encoder_cache.num_encoded > 0
    assert cluster.decode.core.kv_transfer.stats.num_imported >= 4  # (n=2: two handoffs)
    # Anthropic's image blocks through the router's Messages API.
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": URLS[i].split(",")[1]}}
              for i in (0, 3)]
    answers = []
    for base in (cluster.single, cluster.router):
        client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
        message = client.messages.create(model=cluster.model, max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                                         messages=[{"role": "user", "content": blocks + [_text("What?")]}])
        counted = client.messages.count_tokens(model=cluster.model, messages=[
            {"role": "user", "content": blocks + [_text("What?")]}]).input_tokens
        answers.append((message.content[0].text, message.usage.output_tokens, counted))
    assert answers[0] == answers[1]
    assert answers[1][2] > 2 * NUM_EMBEDS  # each image's whole token run, as the node counts it
    too_many = {"messages": [{"role": "user", "content": blocks[:1] * 4}]}  # (the nodes take 3 images)
    routed, single = (_post(base, too_many, "/v1/messages/count_tokens") for base in (cluster.router, cluster.single))
    assert routed.status_code == single.status_code == 400 and routed.json() == single.json()
    _clean(cluster)


def test_concurrent_image_requests_through_the_router(cluster):
    jobs = [[{"role": "user", "content": [_image(i % 4), _text(f"Picture {i}?")] +
              ([_image((i + 1) % 4)] if i % 3 == 0 else [])}] for i in range(8)]

    def one(base: str, messages: list[dict]) -> str:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=cluster.model, messages=messages, max_tokens=MAX_TOKENS,
                                               temperature=0, extra_body={"ignore_eos": True})
        return reply.choices[0].message.content

    alone = [one(cluster.single, messages) for messages in jobs]

    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=cluster.router + "/v1", api_key="unused", max_retries=0) as client:
            replies = await asyncio.gather(*(client.chat.completions.create(
                model=cluster.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True}) for messages in jobs))
        return [r.choices[0].message.content for r in replies]

    assert asyncio.run(together()) == alone
    _clean(cluster)


def _bad(part: dict) -> dict:
    return {"messages": [{"role": "user", "content": [_text("What?"), part]}], "max_tokens": 2}


def _url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize("body", [
    _bad(_url(data_url(png(0)[:300]))),
    _bad(_url(data_url(b"just some text"))),
    _bad(_url(data_url(animated_gif(), "image/gif"))),
    _bad(_url(data_url(encoded(picture(0, (200, 150)))))),
    _bad(_url(data_url(bytes(70_000)))),
    _bad(_url("data:image/png;base64,%%%")),
    _bad(_url("https://example.com/a.png")),
    {"messages": [{"role": "user", "content": [_image(0), _image(1), _image(2), _image(3)]}]},
    {"messages": [{"role": "assistant", "content": [_image(0)]}, {"role": "user", "content": "x"}]},
], ids=["truncated", "not-an-image", "animated", "pixels", "bytes", "base64", "remote", "too-many", "assistant"])
def test_bad_images_are_the_same_400_through_the_router(cluster, body):
    single, routed = _post(cluster.single, body), _post(cluster.router, body)
    assert single.status_code == routed.status_code == 400, (single.text, routed.text)
    assert single.json() == routed.json()
