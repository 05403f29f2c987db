"""The router splits <think> into reasoning_content exactly as a node does: the same parser over the
relayed text, streamed and whole (no processes: a fake delta stream in place of the nodes)."""

from __future__ import annotations

import asyncio
import json

from conveyor.cluster.registry import Registry
from conveyor.cluster.router import RouterMetrics, RouterServing
from conveyor.engine.outputs import RequestOutput
from conveyor.server.responses import ChoiceState, ResponseHeader, full_response
from conveyor.structured.output import ChatParsing
from conveyor.testing import smollm_tokenizer

PIECES = ["<th", "ink>\nplan", " it\n</thi", "nk>\n\nThe ", "answer."]


def _serving() -> RouterServing:
    registry = Registry([], [])
    return RouterServing(registry, smollm_tokenizer(), "m", "m", 4, RouterMetrics(registry), "think")


def _deltas():
    outs = [RequestOutput("r", [1], text, num_prompt_tokens=5, num_output_tokens=i + 1) for i, text in enumerate(PIECES)]
    outs[-1].finished, outs[-1].finish_reason = True, "stop"
    return outs


async def _relay(outs):
    for out in outs:
        yield out


def test_a_streamed_reply_is_split_into_reasoning_and_content():
    serving = _serving()
    header = ResponseHeader("id", 0, "m", chat=True, want_logprobs=False, parsing=ChatParsing(None, False))
    outs = _deltas()

    async def run():
        deltas = _relay(outs[1:])
        return [event async for event in serving._stream(deltas, outs[0], header, False, 0.0)]

    events = [json.loads(e[6:]) for e in asyncio.run(run()) if e.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content") or "" for d in deltas).strip() == "plan it"
    assert "".join(d.get("content") or "" for d in deltas) == "The answer."
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    # A node's JSON answer for the same text (server/responses.py, which the router's JSON path uses).
    choice = ChoiceState(0)
    for out in outs:
        choice.add(out)
    message = full_response(header, [choice], serving.token_text, 1)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("plan it", "The answer.")
