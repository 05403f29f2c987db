"""Four real processes on loopback: one decode node (whose own HTTP API is the single-node
reference), two prefill nodes and a router, all on the tiny random model (its chat template thinks: see
parity_battery.py). One topology serves every test here, in order: outputs first, then failures that kill
nodes one by one."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from cluster_harness import call, free_port, start, wait_for, wait_healthy
from parity_battery import ASK, CHAT, SCHEMA, THINK_TEMPLATE, agent_battery, battery, fetch, fetch_agent, spliced
from conveyor.cluster import wire
from conveyor.testing import write_tiny_model_dir

pytestmark = [pytest.mark.batch_invariant, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def topo(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    model = write_tiny_model_dir(root / "tiny-model")
    config_path = Path(model) / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": THINK_TEMPLATE}))
    logs = str(root)
    # The decode node's own HTTP API is the single-node path (same model, same flags): it is the
    # reference, computed before anything is routed through it.
    decode = start("decode", model, logs, "decode")
    prefill_a = start("prefill-a", model, logs, "prefill", ["--decode-peers", decode.serving])
    prefill_b = start("prefill-b", model, logs, "prefill", ["--decode-peers", decode.serving])
    router = start("router", model, logs, "router", [
        "--prefill-peers", f"{prefill_a.serving},{prefill_b.serving}", "--decode-peers", decode.serving,
        "--health-check-interval", "0.25"], serving=False)
    procs = [decode, prefill_a, prefill_b, router]
    try:
        wait_healthy(procs)  # the router is healthy once its monitor has seen both pools online
        yield {"single": decode, "decode": decode, "a": prefill_a, "b": prefill_b, "router": router}
    finally:
        for proc in procs:
            proc.stop()


def requests_16() -> list[tuple[str, dict]]:
    out = []
    for i in range(16):
        stream = i % 2 == 0
        if i % 4 < 2:
            body = {"messages": [{"role": "user", "content": f"Question {i}: name {i + 2} colors."}],
                    "max_tokens": 12 + i, "temperature": 0, "stream": stream}
            path = "/v1/chat/completions"
        else:
            body = {"prompt": f"Once upon a time, number {i} " * (1 + i % 3), "max_tokens": 10 + i,
                    "temperature": 0, "stream": stream}
            path = "/v1/completions"
        if stream:
            body["stream_options"] = {"include_usage": True}
        out.append((path, body))
    out[3][1]["max_tokens"] = 1  # finishes on the prefill node: nothing to hand off
    out[5][1].update(temperature=0.8, seed=11)  # seeded sampling continues with the generator's state
    out[7][1]["stop"] = [" ", "a"]  # stop strings are applied where the text is made
    return out


def stats(topo) -> dict:
    return httpx.get(f"{topo['router'].url}/router/stats", timeout=5).json()


def node(stats_body: dict, role: str, proc) -> dict:
    return next(n for n in stats_body[role] if n["address"] == proc.serving)


def test_router_matches_single_node_byte_for_byte(topo):
    work = requests_16()
    with ThreadPoolExecutor(16) as pool:
        reference = list(pool.map(lambda w: call(topo["single"].url, *w), work))
        routed = list(pool.map(lambda w: call(topo["router"].url, *w), work))
    assert routed == reference
    assert {r["finish_reason"] for r in reference} >= {"length"}
    body = stats(topo)
    assert all(n["dispatched"] >= 4 for n in body["prefill"]), body  # round-robin used both
    assert node(body, "decode", topo["decode"])["dispatched"] == 16
    assert body["routing"]["completed"] >= 16 and body["routing"]["retries"] == 0


def test_router_answers_the_battery_as_a_node_does(topo):
    """Plain, streamed, stop strings, n=2 seeded, logprobs, json_schema, tools auto/required/named/cut, a
    tool-result turn, a <think> prompt, text completions: whole responses byte for byte but for ids and
    timestamps."""
    reference = _node_and_router_agree(topo, battery(), fetch)
    # The battery means what it says: each feature showed up in the reference answers.
    body = {name: r["body"] for name, r in reference.items() if "body" in r}
    assert all(r["status"] == 200 for name, r in reference.items() if "body" in r)
    assert len(body["n2-seeded"]["choices"]) == 2 and len(body["text-batch-n2"]["choices"]) == 4
    assert body["n2-seeded"]["choices"][0]["message"] != body["n2-seeded"]["choices"][1]["message"]
    assert len(body["logprobs"]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
    assert json.loads(body["json-schema"]["choices"][0]["message"]["content"]).keys() == {"kind", "n", "tags"}
    for name in ("tools-required", "tools-named", "tools-auto-call"):
        assert body[name]["choices"][0]["finish_reason"] == "tool_calls", name
    assert body["tools-named"]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "add"
    assert body["think"]["choices"][0]["message"]["reasoning_content"]  # the prompt opened <think>
    streamed = reference["think-grammar-streamed"]["0"]
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in streamed) == "ok"
    assert body["text-choice"]["choices"][0]["text"] in ("yes", "no", "maybe")


def test_router_answers_the_agent_apis_as_a_node_does(topo):
    """Anthropic Messages (and OpenAI Responses) through the router: the node's answers, event for event, but
    for ids, times and the prefix cache's share of the prompt (each node's own history)."""
    model = httpx.get(f"{topo['single'].url}/v1/models", timeout=10).json()["data"][0]["id"]
    reference = _node_and_router_agree(topo, agent_battery(model), fetch_agent)
    body = {name: r["body"] for name, r in reference.items() if "body" in r}
    assert all(r["status"] == 200 for name, r in reference.items() if "body" in r)
    assert body["messages-tool-forced"]["stop_reason"] == "tool_use"
    assert [b["type"] for b in body["messages-think"]["content"]][0] == "thinking"
    assert body["messages-stop"]["stop_reason"] in ("stop_sequence", "end_turn", "max_tokens")
    blocks = [d["content_block"]["type"] for n, d in reference["messages-think-budget-streamed"]["events"]
              if n == "content_block_start"]
    assert blocks[:2] == ["thinking", "text"]  # the budget closed the thinking, the answer followed
    events = [name for name, _ in reference["messages-tool-any-streamed"]["events"]]
    assert events[0] == "message_start" and events[-1] == "message_stop" and "ping" in events
    assert json.loads(body["responses-json"]["output"][-1]["content"][0]["text"]).keys() == {"kind", "n", "tags"}
    assert body["responses-think"]["output"][0]["type"] == "reasoning"
    assert body["responses-tool-output"]["status"] in ("completed", "incomplete")
    events = [name for name, _ in reference["responses-tool-forced-streamed"]["events"]]
    assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "response.completed"
    assert "response.function_call_arguments.done" in events


def _node_and_router_agree(topo, work: dict, fetcher) -> dict:
    """Each request of `work` to the single node and through the router; equal answers; the node's returned."""
    with ThreadPoolExecutor(8) as pool:
        reference = dict(zip(work, pool.map(lambda w: fetcher(topo["single"].url, *w), work.values())))
        routed = dict(zip(work, pool.map(lambda w: fetcher(topo["router"].url, *w), work.values())))
    for name in work:
        assert routed[name] == reference[name], f"{name}: {_first_difference(routed[name], reference[name])}"
    return reference


def _first_difference(a, b):
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if a.get(key) != b.get(key):
                return [key, *_first_difference(a.get(key), b.get(key))]
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return [i, *_first_difference(x, y)]
        if len(a) != len(b):
            return [f"lengths {len(a)} != {len(b)}"]
    return [a, b] if a != b else []


def test_router_renders_the_history_a_node_renders(topo):
    """A tool turn's tool_calls and tool_call_id reach the prompt through the router as on a node
    (same prompt_tokens, same text); tool_choice without tools is the node's 400."""
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    for stream in (False, True):
        body = {"messages": history, "max_tokens": 8, "temperature": 0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        reference = call(topo["single"].url, "/v1/chat/completions", body)
        assert call(topo["router"].url, "/v1/chat/completions", body) == reference
        assert reference["usage"]["prompt_tokens"] > 40  # the call and its result are in the prompt
    bad = {"messages": history, "max_tokens": 4, "tool_choice": "auto"}
    answers = [httpx.post(f"{topo[name].url}/v1/chat/completions", json=bad, timeout=30) for name in ("single", "router")]
    assert [a.status_code for a in answers] == [400, 400]
    assert answers[0].json()["error"] == answers[1].json()["error"]


def test_router_serves_health_models_metrics(topo):
    base = topo["router"].url
    assert httpx.get(f"{base}/health").json()["prefill_online"] == 2
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "tiny-model"
    metrics = httpx.get(f"{base}/metrics").text
    assert 'conveyor_router_node_up{address="%s",role="prefill"} 1.0' % topo["a"].serving in metrics
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {"a": {"type": "no"}}}}}
    for extra, param in (({"response_format": bad_schema}, "response_format"),  # refused by the prefill node
                         ({"guided_json": bad_schema["json_schema"]["schema"]}, "guided_json"),
                         ({"guided_regex": "(unclosed"}, "guided_regex"),
                         ({"top_logprobs": 2}, "top_logprobs"), ({"n": 2, "top_p": 7.0}, "top_p"),
                         ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
                           "response_format": {"type": "json_object"}}, "response_format")):
        body = {"messages": [{"role": "user", "content": "x"}], **extra}
        answers = [httpx.post(f"{topo[name].url}/v1/chat/completions", json=body, timeout=30)
                   for name in ("single", "router")]
        assert [a.status_code for a in answers] == [400, 400], [a.text for a in answers]
        assert answers[1].json() == answers[0].json() and answers[0].json()["error"]["param"] == param
    for path, body in (("/tokenize", {"content": "Hello <|im_start|> wörld", "with_pieces": True}),
                       ("/tokenize", {"prompt": "x", "add_special": True}), ("/detokenize", {"tokens": [9906, 28, 2]}),
                       ("/detokenize", {"tokens": [1 << 20]})):  # the last: out of the vocabulary, a 400
        answers = [httpx.post(f"{topo[name].url}{path}", json=body, timeout=30) for name in ("single", "router")]
        assert (answers[1].status_code, answers[1].content) == (answers[0].status_code, answers[0].content)
    deep = httpx.post(f"{base}/v1/completions", content='{"prompt": ' + "[" * 200 + "]" * 200 + "}",
                      headers={"content-type": "application/json"})
    assert deep.status_code == 400 and deep.json()["error"]["type"] == "invalid_request_error"  # single-node limits
    for bad, param in (({"top_p": 7.0}, "top_p"), ({"max_tokens": 0}, "max_tokens")):
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param  # refused by the prefill node


def _raw(address: str, payload: bytes) -> wire.Frame | None:
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    if not data:
        return None
    length = wire.parse_header(data[:wire.HEADER.size])
    return wire.decode(data[wire.HEADER.size:wire.HEADER.size + length])


@pytest.mark.parametrize("payload", [
    b"GET / HTTP/1.1\r\n\r\n",  # not our magic
    struct.pack(">4sBI", b"CNVY", 99, 2) + b"{}",  # unknown version
    struct.pack(">4sBI", b"CNVY", wire.VERSION, 1 << 31),  # longer than the limit
    struct.pack(">4sBI", b"CNVY", wire.VERSION, 50) + b"short",  # truncated body
    struct.pack(">4sBI", b"CNVY", wire.VERSION, 3) + b"\x81\xa1x",  # msgpack, but no known frame
    wire.encode(wire.TokenFrame(request_id="r", token_ids=[], text="")),  # a frame, but the wrong kind
], ids=["magic", "version", "length", "truncated", "unknown", "wrong-kind"])
def test_malformed_frames_are_rejected_without_harm(topo, payload):
    for proc in (topo["a"], topo["decode"]):
        reply = _raw(proc.serving, payload)
        assert isinstance(reply, wire.ErrorFrame) and reply.code == "bad_frame" and reply.status == 400
        assert httpx.get(f"{proc.url}/health").status_code == 200


def test_unreachable_decode_target_falls_back_to_decode_peers(topo):
    """A router-named decode node that does not answer: the prefill node hands off to its --decode-peers."""
    async def go():
        from conveyor.cluster import transport

        reader, writer = await transport.connect(topo["b"].serving)
        await transport.write_frame(writer, wire.GenerateFrame(
            request_id="fallback-1", prompt_token_ids=[1, 2, 3, 4, 5],
            sampling=wire.SamplingWire(max_tokens=6, temperature=0.0, ignore_eos=True),
            decode_target=f"127.0.0.1:{free_port()}"))  # nothing listens there
        frames = []
        while not (frames and frames[-1].finished):
            frames.append(await transport.read_frame(reader))
        writer.close()
        return frames

    frames = asyncio.run(go())
    assert [f.node for f in frames][:2] == ["prefill", "decode"] and frames[-1].finish_reason == "length"
    assert frames[-1].num_output_tokens == 6 and sum(len(f.token_ids) for f in frames) == 6


def _live_blocks(proc) -> int:
    return httpx.get(f"{proc.url}/v1/cache/stats", timeout=5).json()["live"]


def test_client_disconnect_cancels_on_both_nodes(topo):
    body = {"prompt": "count with me: 1 2 3", "max_tokens": 3000, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.Client(base_url=topo["router"].url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            assert _live_blocks(topo["decode"]) > 0
    wait_for(lambda: _live_blocks(topo["decode"]) == 0, 120, "decode node to free the blocks")
    assert _live_blocks(topo["a"]) == 0 and _live_blocks(topo["b"]) == 0
    wait_for(lambda: stats(topo)["routing"]["cancelled"] >= 1, 120, "the router to count the cancel")


def test_kill_9_of_a_prefill_node_under_load_loses_nothing(topo):
    work = [w for w in requests_16() if w[1].get("temperature") == 0]
    schema = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    work += [(CHAT, {"messages": ASK, "temperature": 1.0, "seed": 5 + i, "response_format": schema,
                     "stream": i == 1}) for i in range(2)]  # seeded and constrained: spliced too
    for path, body in work:
        body["max_tokens"] = 120  # long enough that the kill lands mid-stream
        body["ignore_eos"] = True
        body["cache_prompt"] = False
        body["logprobs"] = True if path == CHAT else 2  # a retry must not repeat the logprobs sent
        body["top_logprobs" if path == CHAT else "logprobs"] = 2
        body.pop("stop", None)
    with ThreadPoolExecutor(16) as pool:
        reference = [spliced(r) for r in pool.map(lambda w: fetch(topo["single"].url, *w), work)]
        dispatched = node(stats(topo), "prefill", topo["a"])["dispatched"]
        futures = [pool.submit(lambda w: spliced(fetch(topo["router"].url, *w)), w) for w in work]
        # A counter, not the short in-flight state a late poll can miss (prefill is brief).
        wait_for(lambda: node(stats(topo), "prefill", topo["a"])["dispatched"] > dispatched, 120, "load on prefill-a")
        time.sleep(0.3)
        topo["a"].kill9()
        wait_for(lambda: node(stats(topo), "prefill", topo["a"])["status"] == "unreachable", 120,
                 "prefill-a marked unreachable")
        routed = [f.result() for f in futures]
    assert routed == reference  # every request finished, byte for byte, retried ones spliced
    body = stats(topo)
    assert body["routing"]["retries"] >= 1 and node(body, "prefill", topo["b"])["status"] == "online"


def test_decode_node_death_mid_stream_ends_streams_with_an_error(topo):
    body = {"prompt": "a b c", "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(base_url=topo["router"].url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) == 5:
                        topo["decode"].kill9()
    assert "error" in events[-1] and events[-1]["choices"][0]["finish_reason"] == "error"
    wait_for(lambda: _live_blocks(topo["b"]) == 0, 120, "prefill side idle")
    wait_for(lambda: stats(topo)["decode"][0]["status"] == "unreachable", 120, "decode node marked")
    r = httpx.post(f"{topo['router'].url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_decode_node"


def test_no_prefill_node_left_is_a_clean_503(topo):
    topo["b"].kill9()
    wait_for(lambda: stats(topo)["prefill"][1]["status"] == "unreachable", 120, "prefill-b marked")
    r = httpx.post(f"{topo['router'].url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "stream": True}, timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "no_prefill_node" and r.json()["error"]["type"] == "unavailable"
    assert httpx.get(f"{topo['router'].url}/health").status_code == 503
