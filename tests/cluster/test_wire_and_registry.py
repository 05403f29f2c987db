"""The pieces without a model: frames, addresses, the allowlist, the pools and the health monitor."""

from __future__ import annotations

import asyncio
import struct
import time

import pytest

from conveyor.cluster import transport, wire
from conveyor.cluster.health import HealthMonitor
from conveyor.cluster.prefill import parse_allowlist
from conveyor.cluster.registry import NodeStatus, Registry
from conveyor.config import ClusterConfig, ConfigError, load_cluster_config


def test_frames_round_trip_and_are_length_checked():
    frame = wire.HandoffFrame(request_id="r", prompt_token_ids=[1, 2, 3], output_token_ids=[4],
                              sampling=wire.SamplingWire(max_tokens=8, temperature=0.0, logit_bias={5: -1.0}),
                              kv=wire.KVPayload(2, 3, 2, 16, "bfloat16", b"\x01" * 10), rng_state=b"\x00\x01")
    data = wire.encode(frame)
    assert data[:4] == b"CNVY" and wire.parse_header(data[:9]) == len(data) - 9
    assert wire.decode(data[9:]) == frame
    with pytest.raises(wire.WireError, match="magic"):
        wire.parse_header(b"HTTP/" + data[5:9])
    with pytest.raises(wire.WireError, match="version"):
        wire.parse_header(struct.pack(">4sBI", b"CNVY", wire.VERSION + 1, 5))
    with pytest.raises(wire.WireError, match="limit"):
        wire.parse_header(struct.pack(">4sBI", b"CNVY", wire.VERSION, wire.MAX_FRAME_BYTES + 1))
    with pytest.raises(wire.WireError, match="malformed"):
        wire.decode(data[9:-3])
    with pytest.raises(wire.WireError, match="malformed"):  # unknown fields are refused, not ignored
        wire.decode(wire._encoder.encode({"type": "error", "status": 1, "message": "m", "code": "c", "x": 1}))


def test_q8_0_payload_carries_its_cache_types_and_bf16_stays_as_before():
    q8 = wire.KVPayload(2, 3, 2, 32, "bfloat16", b"\x01" * 10, cache_type_k="q8_0", cache_type_v="q8_0")
    frame = wire.HandoffFrame(request_id="r", prompt_token_ids=[1], output_token_ids=[2],
                              sampling=wire.SamplingWire(max_tokens=8), kv=q8)
    assert wire.decode(wire.encode(frame)[9:]).kv == q8
    plain = wire._encoder.encode(wire.KVPayload(2, 3, 2, 32, "bfloat16", b"\x01"))
    assert b"cache_type" not in plain  # defaults omitted: an older node reads a bf16 payload as it did


def test_the_whole_sampling_contract_and_logprobs_round_trip():
    from conveyor.cluster.node import logprobs_from_wire, logprobs_to_wire, to_sampling_params, to_wire
    from conveyor.engine.outputs import TokenLogprob
    from conveyor.engine.sampling_params import SamplingParams
    from conveyor.structured.grammar import GrammarSpec

    params = SamplingParams(max_tokens=9, temperature=0.7, stop=["\n"], seed=3, logprobs=2, logit_bias={4: 1.5},
                            structured=GrammarSpec.json_schema({"type": "object"}))
    frame = wire.GenerateFrame(request_id="r", prompt_token_ids=[1], sampling=to_wire(params))
    back = wire.decode(wire.encode(frame)[9:])
    assert to_sampling_params(back.sampling, 9) == params
    logprobs = [TokenLogprob(5, -0.1234567890123, [(5, -0.1234567890123), (7, -2.5)]), TokenLogprob(8, -1e-9)]
    tokens = wire.TokenFrame(request_id="r", token_ids=[5, 8], text="ab", logprobs=logprobs_to_wire(logprobs))
    assert logprobs_from_wire(wire.decode(wire.encode(tokens)[9:]).logprobs) == logprobs  # float64: exact
    bad = wire._encoder.encode(_with_grammar_kind(frame, "nonsense"))
    with pytest.raises(wire.WireError, match="malformed"):  # a grammar kind no node knows is a bad frame
        wire.decode(bad)


def _with_grammar_kind(frame, kind: str):
    import msgspec

    return msgspec.structs.replace(frame, sampling=msgspec.structs.replace(
        frame.sampling, grammar=msgspec.structs.replace(frame.sampling.grammar, kind=kind)))


def test_read_frame_reports_truncation_and_clean_close():
    async def go():
        async def feed(data: bytes):
            reader = asyncio.StreamReader()
            reader.feed_data(data)
            reader.feed_eof()
            return await transport.read_frame(reader)

        with pytest.raises(transport.PeerClosed):
            await feed(b"")
        with pytest.raises(wire.WireError, match="header"):
            await feed(b"CNV")
        with pytest.raises(wire.WireError, match="truncated"):
            await feed(struct.pack(">4sBI", b"CNVY", wire.VERSION, 20) + b"abc")
        ok = wire.ErrorFrame(status=503, message="busy", code="overloaded")
        assert await feed(wire.encode(ok)) == ok

    asyncio.run(go())


def test_addresses_and_allowlist():
    assert transport.parse_address("127.0.0.1:80") == ("127.0.0.1", 80)
    assert transport.parse_address("[::1]:9") == ("::1", 9)
    for bad in ("nohost", "h:0", "h:x", ":5"):
        with pytest.raises(ValueError):
            transport.parse_address(bad)
    assert transport.numeric_address("localhost:5") is None
    assert parse_allowlist(None) is None
    assert parse_allowlist("10.0.0.1:7000, localhost:9, bad, [::1]:5") == {("10.0.0.1", 7000), ("::1", 5)}


def test_cluster_config_from_flags_and_env():
    assert load_cluster_config(env={}).node_role is None
    cfg = load_cluster_config(env={"CONVEYOR_NODE_ROLE": "prefill", "CONVEYOR_SERVING_BIND": "127.0.0.1:1",
                                   "MLXCEL_DECODE_ALLOWLIST": "10.0.0.1:2"})
    assert cfg.decode_allowlist == "10.0.0.1:2"
    assert load_cluster_config(env={"CONVEYOR_DECODE_ALLOWLIST": "a", "MLXCEL_DECODE_ALLOWLIST": "b"}
                               ).decode_allowlist == "a"
    with pytest.raises(ConfigError, match="serving-bind"):
        ClusterConfig(node_role="decode")
    with pytest.raises(ConfigError, match="prefill-peers"):
        ClusterConfig(node_role="router", decode_peers="127.0.0.1:1")
    assert ClusterConfig(node_role="router", prefill_peers="a:1, b:2", decode_peers="c:3").prefill_peer_list == \
        ["a:1", "b:2"]


def test_round_robin_skips_unreachable_nodes():
    registry = Registry(["a:1", "b:2", "c:3"], ["d:4"])
    pool = registry.prefill
    assert [pool.pick().address for _ in range(4)] == ["a:1", "b:2", "c:3", "a:1"]
    pool.mark_unreachable(pool.nodes[1], "test")
    assert [pool.pick().address for _ in range(3)] == ["c:3", "a:1", "c:3"]
    assert pool.pick(exclude=[pool.nodes[0], pool.nodes[2]]) is None
    pool.mark_online(pool.nodes[1])
    assert pool.nodes[1].status == NodeStatus.ONLINE and pool.nodes[1].num_marked_unreachable == 1
    assert registry.view()["prefill"][1]["status"] == "online"


def test_health_monitor_marks_and_restores_a_node():
    """Waits on the event, never on a deadline: the one-shot probes get a generous timeout (a loaded
    box can stall a loopback connect past 50 ms), and the loop's restore is awaited until seen."""
    async def go():
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        registry = Registry([f"127.0.0.1:{port}"], [f"127.0.0.1:{transport_free_port()}"])
        probe = HealthMonitor(registry, interval=60.0, timeout=30.0)
        await probe.probe_all()
        assert registry.prefill.nodes[0].online and not registry.decode.nodes[0].online  # nothing listens there
        server.close()
        await server.wait_closed()
        await probe.probe_all()
        assert not registry.prefill.nodes[0].online
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
        monitor = HealthMonitor(registry, interval=0.05)
        monitor.start()
        deadline = time.monotonic() + 120  # only a hang ends here; the restore is seen within a round or two
        while not registry.prefill.nodes[0].online and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        restored = registry.prefill.nodes[0].online  # a later round may time out again under load: read it now
        await monitor.stop()
        server.close()
        assert restored and monitor.num_rounds >= 1

    asyncio.run(go())


def transport_free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_router_admission_refuses_before_dispatch():
    from conveyor.cluster.router import RouterMetrics, RouterServing
    from conveyor.server.errors import APIError

    registry = Registry(["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:3"])
    serving = RouterServing(registry, object(), "m", "m", max_queue_depth=2, metrics=RouterMetrics(registry))
    serving._admit()  # room: nothing raised
    serving.num_awaiting_first_token = 4  # 2 per online prefill node
    with pytest.raises(APIError) as refused:
        serving._admit()
    assert (refused.value.status, refused.value.type, refused.value.headers) == (503, "overloaded", {"Retry-After": "1"})
    serving.num_awaiting_first_token = 2
    serving._admit(2)  # n=2 fills the bound exactly
    with pytest.raises(APIError):
        serving._admit(3)  # n=3 would pass it: all of its choices are refused, none dispatched
    serving.num_awaiting_first_token = 0
    registry.decode.mark_unreachable(registry.decode.nodes[0], "test")
    with pytest.raises(APIError) as refused:
        serving._admit()
    assert refused.value.code == "no_decode_node"
    for node in registry.prefill.nodes:
        registry.prefill.mark_unreachable(node, "test")
    with pytest.raises(APIError) as refused:
        serving._admit()
    assert refused.value.code == "no_prefill_node" and refused.value.headers == {"Retry-After": "1"}
    assert registry.stats.view()["rejected_overloaded"] == 2 and registry.stats.num_rejected_no_prefill == 1


def test_prefill_node_checks_decode_target_against_the_allowlist():
    from types import SimpleNamespace

    from conveyor.cluster.node import Refusal
    from conveyor.cluster.prefill import PrefillNode

    engine = SimpleNamespace(core=None)
    strict = PrefillNode(engine, ClusterConfig(node_role="prefill", serving_bind="127.0.0.1:1",
                                               decode_peers="10.0.0.1:7000,10.0.0.2:7000",
                                               decode_allowlist="10.0.0.1:7000,10.0.0.3:7000"))
    assert strict._decode_targets("10.0.0.3:7000") == ["10.0.0.3:7000", "10.0.0.1:7000", "10.0.0.2:7000"]
    with pytest.raises(Refusal) as refused:
        strict._decode_targets("10.6.6.6:7000")
    assert (refused.value.frame.status, refused.value.frame.code) == (403, "forbidden")
    with pytest.raises(Refusal):
        strict._decode_targets("evil.example:7000")  # names are never resolved, so never allowed
    assert [strict._decode_targets(None)[0] for _ in range(3)] == ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.1:7000"]
    permissive = PrefillNode(engine, ClusterConfig(node_role="prefill", serving_bind="127.0.0.1:1"))
    assert permissive._decode_targets("10.6.6.6:7000") == ["10.6.6.6:7000"]
    with pytest.raises(Refusal) as refused:
        permissive._decode_targets(None)  # neither a target nor --decode-peers
    assert refused.value.frame.status == 503
