"""The router's RemoteGroup under the node's reply code, in-process (fake relayed streams in place of
the nodes): <think> split as a node splits it, n members merged, a member's refusal answered as a
node's 400 with the others closed, and a relay that breaks ends its choice instead of hanging."""

from __future__ import annotations

import asyncio
import json

import pytest

from conveyor.cluster.registry import Registry
from conveyor.cluster.remote import DispatchError
from conveyor.cluster.router import RemoteGroup, RouterMetrics, RouterServing
from conveyor.engine.outputs import RequestOutput
from conveyor.server.errors import APIError
from conveyor.server.protocol import ChatCompletionRequest
from conveyor.server.reply import stream_reply
from conveyor.server.request_plan import plan_chat_request
from conveyor.server.responses import ChoiceState, ResponseHeader, full_response
from conveyor.structured.output import ChatParsing
from conveyor.testing import smollm_tokenizer

PIECES = ["<th", "ink>\nplan", " it\n</thi", "nk>\n\nThe ", "answer."]


class FakeRemote:
    """A RemoteRequest's stream() without nodes: the given outputs, or an error raised at a position."""

    def __init__(self, request_id: str, outs: list[RequestOutput], fail_at: int | None = None,
                 error: Exception | None = None) -> None:
        self.request_id, self.outs, self.fail_at, self.error = request_id, outs, fail_at, error
        self.closed = False

    async def stream(self):
        try:
            for i, out in enumerate(self.outs):
                if i == self.fail_at:
                    raise self.error
                yield out
            await asyncio.Event().wait()  # a stream that never ends by itself
        finally:
            self.closed = True


def _serving() -> RouterServing:
    registry = Registry([], [])
    return RouterServing(registry, smollm_tokenizer(), "m", "m", 4, RouterMetrics(registry), "think")


def _deltas(request_id: str = "r") -> list[RequestOutput]:
    outs = [RequestOutput(request_id, [1], text, num_prompt_tokens=5, num_output_tokens=i + 1)
            for i, text in enumerate(PIECES)]
    outs[-1].finished, outs[-1].finish_reason = True, "stop"
    return outs


def _events(serving, remotes, header, n=1) -> list[dict]:
    async def run():
        group = RemoteGroup(serving, remotes, 0.0)
        await group.start(None)
        return [event async for event in stream_reply(group, header, serving.token_text, True, n)]

    return [json.loads(e[6:]) for e in asyncio.run(run()) if e.startswith("data: {")]


def test_a_streamed_reply_is_split_into_reasoning_and_content():
    serving = _serving()
    header = ResponseHeader("id", 0, "m", chat=True, want_logprobs=False, parsing=ChatParsing(None, False))
    events = _events(serving, [FakeRemote("r", _deltas())], header)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas).strip() == "plan it"
    assert "".join(d.get("content") or "" for d in deltas) == "The answer."
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-1]["usage"]["completion_tokens"] == 5
    # A node's JSON answer for the same text (the same server/responses.py code).
    choice = ChoiceState(0)
    for out in _deltas():
        choice.add(out)
    message = full_response(header, [choice], serving.token_text, 1)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("plan it", "The answer.")
    assert serving.registry.stats.num_completed == 1 and serving.num_awaiting_first_token == 0


def test_n_members_merge_into_one_stream_with_one_usage():
    serving = _serving()
    header = ResponseHeader("id", 0, "m", chat=False, want_logprobs=False)
    events = _events(serving, [FakeRemote("a", _deltas("a")), FakeRemote("b", _deltas("b"))], header, n=2)
    texts = {0: "", 1: ""}
    for event in events[:-1]:
        texts[event["choices"][0]["index"]] += event["choices"][0]["text"]
    assert texts == {0: "".join(PIECES), 1: "".join(PIECES)}
    assert events[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15,
                                   "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_members_refusal_is_the_nodes_400_and_the_others_are_closed():
    serving = _serving()
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "n": 2,
                                                 "guided_json": {"type": "object"}})
    plan = plan_chat_request(body, serving.tokenizer, "auto", "m")
    refusal = DispatchError(400, "invalid JSON schema: nope", "invalid_request_error", "invalid_request",
                            "response_format")
    unfinished = FakeRemote("a", _deltas("a")[:2])
    remotes = [unfinished, FakeRemote("b", _deltas("b"), fail_at=0, error=refusal)]

    async def run():
        group = RemoteGroup(serving, remotes, 0.0)
        with pytest.raises(APIError) as info:
            await group.start(plan)
        await asyncio.sleep(0)  # let the cancelled pumps run their finally
        return info.value

    error = asyncio.run(run())
    # Named as a node names it: the compiler's param is the field that asked (guided_json), no wire code.
    assert error.body() == {"error": {"message": "invalid JSON schema: nope", "type": "invalid_request_error",
                                      "param": "guided_json", "code": None}}
    assert all(r.closed for r in remotes) and serving.registry.stats.num_failed == 1


def test_a_relay_that_breaks_ends_its_choice_with_an_error():
    serving = _serving()
    header = ResponseHeader("id", 0, "m", chat=False, want_logprobs=False)
    broken = FakeRemote("a", _deltas("a"), fail_at=2, error=RuntimeError("boom"))
    events = _events(serving, [broken], header)
    assert events[-2]["choices"][0]["finish_reason"] == "error" and "boom" in events[-2]["error"]["message"]
    assert broken.closed and serving.registry.stats.num_failed == 1


def test_the_router_answers_images_as_its_nodes_would():
    """A model whose prefill nodes have no tower: a node's own 400, before any node sees the image; nodes that say
    their image marker: the router renders the template with it (the image goes on to the prefill node)."""
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]})
    registry = Registry(["p:1"], ["d:2"])
    serving = RouterServing(registry, smollm_tokenizer(), "m", "m", 4, RouterMetrics(registry), "think")
    with pytest.raises(APIError, match="model m does not accept images") as refused:
        asyncio.run(serving.plan_chat(body))
    assert refused.value.status == 400 and refused.value.param == "messages.[0].content.[1]"
    registry.prefill.nodes[0].image_marker = "<|im_start|>"
    assert serving.image_refusal() is None and serving.image_marker() == "<|im_start|>"
    with pytest.raises(APIError, match="image 1: .*not an image") as refused:  # decoded here: a node's 400
        asyncio.run(serving.plan_chat(body))
    assert refused.value.param == "messages.[0].content.[1]"
