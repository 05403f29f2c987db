"""A routed request whose decode node is lost: greedy and seeded requests move to another decode node
and the client's stream continues without repeating a token, logprob or character; an unseeded sampled
one ends with the loss. A fake prefill node on loopback plays each attempt's frames (no model)."""

from __future__ import annotations

import asyncio

from conveyor.cluster import transport, wire
from conveyor.cluster.registry import Registry
from conveyor.cluster.remote import RemoteRequest

LOST = "decode node 127.0.0.1:9 failed mid-stream: reset"


def _tokens(token: int, text: str, finished: bool = False) -> wire.TokenFrame:
    return wire.TokenFrame(request_id="r", token_ids=[token], text=text, finished=finished,
                           finish_reason="length" if finished else None, num_prompt_tokens=3,
                           num_output_tokens=token, logprobs=[wire.LogprobWire(token, -0.5 * token)])


FIRST = [_tokens(1, "He"), _tokens(2, "llo"),
         wire.TokenFrame(request_id="r", token_ids=[], text="", finished=True, finish_reason="error", error=LOST,
                         node="prefill", error_code=wire.DECODE_LOST)]
SECOND = [_tokens(1, "He"), _tokens(2, "llo"), _tokens(3, " world", finished=True)]


def _run(sampling: wire.SamplingWire, num_decode: int):
    async def go():
        seen: list[wire.GenerateFrame] = []

        async def handle(reader, writer):
            seen.append(await transport.read_frame(reader))
            for frame in (FIRST, SECOND)[min(len(seen), 2) - 1]:
                await transport.write_frame(writer, frame)
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        registry = Registry([address], [f"127.0.0.1:{9 + i}" for i in range(num_decode)])
        outs = [out async for out in RemoteRequest(registry, "r", [5, 6, 7], sampling).stream()]
        server.close()
        return outs, seen, registry

    return asyncio.run(go())


def test_a_lost_decode_node_is_replaced_and_the_stream_spliced():
    outs, seen, registry = _run(wire.SamplingWire(max_tokens=3, temperature=0.0, logprobs=0), num_decode=2)
    assert "".join(o.new_text for o in outs) == "Hello world" and outs[-1].finish_reason == "length"
    assert [t for o in outs for t in o.new_token_ids] == [1, 2, 3]
    assert [lp.token_id for o in outs for lp in o.logprobs] == [1, 2, 3]  # none repeated
    assert [f.decode_target for f in seen] == ["127.0.0.1:9", "127.0.0.1:10"]
    assert registry.stats.num_retries == 1


def test_an_unseeded_sampled_stream_or_no_decode_node_left_ends_with_the_loss():
    for sampling, num_decode in ((wire.SamplingWire(max_tokens=3, temperature=1.0), 2),
                                 (wire.SamplingWire(max_tokens=3, temperature=1.0, seed=4), 1)):
        outs, seen, _ = _run(sampling, num_decode)
        assert "".join(o.new_text for o in outs) == "Hello" and len(seen) == 1
        assert (outs[-1].finish_reason, outs[-1].error) == ("error", LOST)
