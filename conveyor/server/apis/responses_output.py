"""The Responses API's replies: output items of a parsed reply, the Response object, and the SSE events of
a streamed one, in the order OpenAI sends them, each with its sequence_number.

    response.created, response.in_progress,
    per item: output_item.added, [content_part.added, output_text.delta | reasoning_text.delta ...,
              output_text.done | reasoning_text.done, content_part.done]
              | [function_call_arguments.delta, function_call_arguments.done], output_item.done
    response.completed | response.incomplete | (error, response.failed)
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from conveyor.server.apis.responses_input import NAMESPACE_SEP
from conveyor.server.responses import ChoiceState
from conveyor.structured.output import ChatDelta
from conveyor.structured.tools import ToolCall

# The event a finished response ends its stream with, by its status.
FINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ResponseDraft:
    """One response's identity and the request settings every Response object echoes back."""

    id: str
    created_at: int
    model: str
    settings: dict

    def object(self, status: str, output: list[dict], usage: dict | None = None,
               incomplete_reason: str | None = None, error: dict | None = None) -> dict:
        done = status in FINAL_EVENTS
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "background": False,
                "error": error, "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
                "model": self.model, "output": output, "usage": usage if done else None, **self.settings}


@dataclass(frozen=True)
class Outcome:
    """How a reply ended, as a Response says it."""

    status: str  # completed | incomplete | failed
    incomplete_reason: str | None = None
    error: dict | None = None

    @classmethod
    def of(cls, finish_reason: str | None, error: str | None = None) -> Outcome:
        if finish_reason == "length":
            return cls("incomplete", "max_output_tokens")
        if finish_reason == "error":
            return cls("failed", error={"code": "server_error", "message": error or "generation failed"})
        if finish_reason == "abort":  # the server ended it (shutdown grace period over)
            return cls("failed", error={"code": "server_error", "message": "the request was aborted by the server"})
        return cls("completed")


def usage(state: ChoiceState) -> dict:
    prompt, output = state.num_prompt_tokens, state.num_output_tokens
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": state.num_cached_tokens,
                                                             "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + output}


# -- output items ----------------------------------------------------------------------------------
def _text_part(kind: str, text: str) -> dict:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [_text_part("message", text)]}


def reasoning_item(item_id: str, text: str, summary: bool) -> dict:
    """The thinking as reasoning_text; `summary` (the request asked for one) repeats it as the summary:
    there is no separate summarizer here."""
    return {"id": item_id, "type": "reasoning", "status": "completed",
            "summary": [{"type": "summary_text", "text": text}] if summary else [],
            "content": [_text_part("reasoning", text)]}


def function_call_item(call: ToolCall, status: str = "completed", arguments: str | None = None) -> dict:
    """A call of a namespaced function ("namespace.name" to the model) carries its namespace apart."""
    namespace, _, name = call.name.rpartition(NAMESPACE_SEP)
    item = {"id": "fc_" + call.id.removeprefix("call_"), "type": "function_call", "status": status,
            "call_id": call.id, "name": name, "arguments": call.arguments if arguments is None else arguments}
    return {**item, "namespace": namespace} if namespace else item


def output_items(parsed: ChatDelta, truncated: bool, summary: bool) -> list[dict]:
    """A whole reply's items: its thinking, its text (also when empty, unless it only called tools), its calls."""
    items = [reasoning_item(new_id("rs"), parsed.reasoning, summary)] if parsed.reasoning else []
    if parsed.content or not parsed.tool_calls:
        items.append(message_item(new_id("msg"), parsed.content, "incomplete" if truncated else "completed"))
    return items + [function_call_item(call) for call in parsed.tool_calls]


# -- streaming -------------------------------------------------------------------------------------
class EventWriter:
    """One streamed response's events as SSE, numbered from 0."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class OutputWriter:
    """A streamed reply's output items in order: thinking and text stream into the one open item (a new
    item opens when the kind changes); each function call is written whole (calls are parsed whole)."""

    def __init__(self, event: EventWriter, summary: bool) -> None:
        self.event = event
        self.summary = summary
        self.items: list[dict] = []  # in output order; the open item (status in_progress) is the last
        self._open: dict | None = None
        self._text = ""

    @property
    def finished_items(self) -> list[dict]:
        return [item for item in self.items if item is not self._open]

    def feed(self, parsed: ChatDelta) -> list[str]:
        events: list[str] = []
        if parsed.reasoning:
            events += self._stream_text("reasoning", parsed.reasoning)
        if parsed.content:
            events += self._stream_text("message", parsed.content)
        for call in parsed.tool_calls:
            events += self._call(call)
        return events

    def finish(self, truncated: bool) -> list[str]:
        """Close the open item; a reply that wrote no text and called no tool still has its (empty) message."""
        events = self.close("incomplete" if truncated else "completed")
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            events += self._open_item("message")
            events += self.close("incomplete" if truncated else "completed")
        return events

    def close(self, status: str = "completed") -> list[str]:
        item = self._open
        if item is None:
            return []
        index, kind, text = len(self.items) - 1, item["type"], self._text
        where = {"item_id": item["id"], "output_index": index}
        if kind == "message":
            events = [self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])]
            done = message_item(item["id"], text, status)
        else:
            events = [self.event("response.reasoning_text.done", **where, content_index=0, text=text)]
            done = reasoning_item(item["id"], text, self.summary)
        events.append(self.event("response.content_part.done", **where, content_index=0, part=_text_part(kind, text)))
        if kind == "reasoning" and self.summary:
            events += self._summary(where, text)
        self.items[index], self._open = done, None
        events.append(self.event("response.output_item.done", output_index=index, item=done))
        return events

    def _open_item(self, kind: str) -> list[str]:
        item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []} \
            if kind == "message" else {"id": new_id("rs"), "type": "reasoning", "status": "in_progress",
                                       "summary": [], "content": []}
        self.items.append(item)
        self._open, self._text = item, ""
        index = len(self.items) - 1
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                           part=_text_part(kind, ""))]

    def _stream_text(self, kind: str, delta: str) -> list[str]:
        events: list[str] = []
        if self._open is None or self._open["type"] != kind:
            events += self.close()
            events += self._open_item(kind)
        self._text += delta
        where = {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if kind == "message":
            events.append(self.event("response.output_text.delta", **where, delta=delta, logprobs=[]))
        else:
            events.append(self.event("response.reasoning_text.delta", **where, delta=delta))
        return events

    def _summary(self, where: dict, text: str) -> list[str]:
        part = {"type": "summary_text", "text": text}
        return [self.event("response.reasoning_summary_part.added", **where, summary_index=0,
                           part={**part, "text": ""}),
                self.event("response.reasoning_summary_text.delta", **where, summary_index=0, delta=text),
                self.event("response.reasoning_summary_text.done", **where, summary_index=0, text=text),
                self.event("response.reasoning_summary_part.done", **where, summary_index=0, part=part)]

    def _call(self, call: ToolCall) -> list[str]:
        events = self.close()
        index = len(self.items)
        item = function_call_item(call)
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": index}
        return events + [
            self.event("response.output_item.added", output_index=index,
                       item=function_call_item(call, "in_progress", arguments="")),
            self.event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self.event("response.function_call_arguments.done", **where, arguments=call.arguments),
            self.event("response.output_item.done", output_index=index, item=item)]

