"""One request through the cluster: pick nodes, dispatch, fail over, and splice a retried stream.

Each attempt dials a prefill node (round-robin over those online that serve the request's model)
and names a decode node (independently round-robin, among those serving the same model) in the
frame. A transport failure with the prefill node (refused, reset, EOF before the final frame)
marks it unreachable and the request moves to the next online one. A stream whose decode node
is lost (the prefill node reports `decode_lost`) moves to another decode node the same way.
Greedy and seeded requests regenerate the same tokens there, so the first `num_tokens_sent`
tokens (with their logprobs) and `num_chars_sent` characters of the new stream are dropped and
the client sees one unbroken stream; an unseeded sampled request that already streamed text
cannot be spliced and ends with an error instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from conveyor.cluster import transport
from conveyor.cluster.node import _TRANSPORT_ERRORS, logprobs_from_wire
from conveyor.cluster.registry import Node, Registry
from conveyor.cluster.transport import PeerClosed
from conveyor.cluster.wire import DECODE_LOST, WRONG_MODEL, ErrorFrame, GenerateFrame, ImageWire, SamplingWire, \
    TokenFrame, WireError
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.sampling_params import GREEDY_TEMPERATURE

_BUSY_CODES = {"overloaded", "unavailable"}


class DispatchError(Exception):
    """The request cannot start: status/type/code for the OpenAI-shaped answer."""

    def __init__(self, status: int, message: str, type: str, code: str | None = None, param: str | None = None,
                 retry_after: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.retry_after = retry_after


def no_prefill(model: str | None = None) -> DispatchError:
    return DispatchError(503, f"No prefill node{_serving(model)} is available. Retry later.", "unavailable",
                         "no_prefill_node", retry_after=True)


def no_decode(model: str | None = None) -> DispatchError:
    return DispatchError(503, f"No decode node{_serving(model)} is available. Retry later.", "unavailable",
                         "no_decode_node", retry_after=True)


def _serving(model: str | None) -> str:
    return f" serving '{model}'" if model is not None else ""


def overloaded() -> DispatchError:
    return DispatchError(503, "Server is busy. Retry later.", "overloaded", retry_after=True)


@dataclass
class RemoteRequest:
    registry: Registry
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingWire
    priority: int = 0
    cache_prompt: bool = True
    model: str | None = None  # only nodes serving it are picked (None: any node)
    images: list[ImageWire] = field(default_factory=list)  # one per image marker in the prompt

    @property
    def deterministic(self) -> bool:
        return self.sampling.temperature < GREEDY_TEMPERATURE or self.sampling.seed is not None

    async def stream(self) -> AsyncIterator[RequestOutput]:
        """RequestOutput deltas (the last has finished=True); DispatchError before the first one."""
        registry = self.registry
        tried: list[Node] = []
        decodes_lost: list[Node] = []
        lost_error: str | None = None  # what the last lost decode node's prefill node said
        num_chars_sent = 0
        num_tokens_sent = 0
        num_yielded = 0
        num_output_tokens = 0
        busy = False
        attempt = 0
        while True:
            node = registry.prefill.pick(exclude=tried, model=self.model)
            decode = registry.decode.pick(exclude=decodes_lost, model=self.model)
            if node is None or decode is None:
                error = overloaded() if busy else no_prefill(self.model) if node is None else no_decode(self.model)
                if not num_yielded:
                    raise error
                lost = decode is None and node is not None and lost_error is not None
                yield _error_output(self.request_id, lost_error if lost else error.message, num_output_tokens)
                return
            if attempt:
                registry.stats.num_retries += 1
            attempt += 1
            frame = GenerateFrame(request_id=f"{self.request_id}-{attempt}", prompt_token_ids=self.prompt_token_ids,
                                  sampling=self.sampling, priority=self.priority, cache_prompt=self.cache_prompt,
                                  decode_target=decode.address, model=self.model, images=self.images)
            skip, skip_tokens = num_chars_sent, num_tokens_sent
            writer = None
            node.num_in_flight += 1
            try:
                reader, writer = await transport.connect(node.address)
                node.num_dispatched += 1
                decode.num_dispatched += 1
                await transport.write_frame(writer, frame)
                while True:
                    reply = await transport.read_frame(reader)
                    if isinstance(reply, ErrorFrame):
                        if reply.code in _BUSY_CODES or reply.code == WRONG_MODEL:
                            # The next node may have room, or serve the model (the registry's view was stale).
                            busy |= reply.code in _BUSY_CODES
                            tried.append(node)
                            break
                        error = DispatchError(reply.status, reply.message, _error_type(reply.status), reply.code,
                                              reply.param)
                        if not num_yielded:
                            raise error
                        yield _error_output(self.request_id, error.message, num_output_tokens)
                        return
                    if not isinstance(reply, TokenFrame):
                        raise WireError(f"unexpected {type(reply).__name__} from a prefill node")
                    if reply.error_code == DECODE_LOST and self.deterministic:
                        decodes_lost.append(decode)  # (the health monitor decides whether it is down)
                        lost_error = reply.error
                        break  # rerun on another decode node, the tokens already sent skipped
                    out = _output(self.request_id, reply, num_output_tokens)
                    num_output_tokens = out.num_output_tokens
                    if skip or skip_tokens:  # a retry regenerates what the client already has
                        cut = min(skip, len(out.new_text))
                        out.new_text = out.new_text[cut:]
                        skip -= cut
                        cut = min(skip_tokens, len(out.new_token_ids))
                        out.new_token_ids, out.logprobs = out.new_token_ids[cut:], out.logprobs[cut:]
                        skip_tokens -= cut
                    num_chars_sent += len(out.new_text)
                    num_tokens_sent += len(out.new_token_ids)
                    num_yielded += 1
                    yield out
                    if out.finished:
                        return
            except (PeerClosed, WireError, *_TRANSPORT_ERRORS) as exc:
                node.num_failures += 1
                registry.prefill.mark_unreachable(node, f"dispatch: {exc or type(exc).__name__}")
                tried.append(node)
                if num_yielded and not self.deterministic:
                    yield _error_output(self.request_id, f"prefill node {node.address} failed mid-stream and an "
                                        "unseeded sampled request cannot be resumed", num_output_tokens)
                    return
            finally:
                node.num_in_flight -= 1
                transport.close(writer)


def _output(request_id: str, frame: TokenFrame, num_output_tokens: int) -> RequestOutput:
    return RequestOutput(request_id, new_token_ids=list(frame.token_ids), new_text=frame.text,
                         finished=frame.finished, finish_reason=frame.finish_reason,
                         num_prompt_tokens=frame.num_prompt_tokens,
                         num_output_tokens=max(frame.num_output_tokens, num_output_tokens),
                         num_cached_tokens=frame.num_cached_tokens, error=frame.error,
                         logprobs=logprobs_from_wire(frame.logprobs), stop_sequence=frame.stop_sequence)


def _error_output(request_id: str, message: str, num_output_tokens: int) -> RequestOutput:
    return RequestOutput(request_id, finished=True, finish_reason="error", error=message,
                         num_output_tokens=num_output_tokens)


def _error_type(status: int) -> str:
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


async def cancel_quietly(task: asyncio.Task) -> None:
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - whatever it died of, it is gone
        pass
