"""Prefill role: prefill a routed request, sample its first token, hand the KV to a decode node,
and relay the decode node's continuation back to the router on the same connection.

    router ──GenerateFrame──> prefill ──HandoffFrame──> decode
           <──TokenFrame(first)──     <──TokenFrame...──
           <──TokenFrame... (relayed)

Closing the router connection cancels the request here (engine abort) and, by closing the
decode connection, there too. A decode node that dies mid-stream ends the stream with an
error frame; its blocks here were freed at the handoff.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from conveyor.cluster import transport
from conveyor.cluster.images import images_from_wire, spans_to_wire
from conveyor.cluster.node import _TRANSPORT_ERRORS, FrameServer, compile_grammar, image_marker_of, logprobs_to_wire, \
    refuse, run_unless_closed, to_sampling_params, to_wire
from conveyor.cluster.transport import PeerClosed
from conveyor.cluster.wire import DECODE_LOST, WRONG_MODEL, ErrorFrame, Frame, GenerateFrame, HandoffFrame, KVPayload, \
    TokenFrame, WireError
from conveyor.config import ClusterConfig
from conveyor.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from conveyor.engine.kv_transfer import KVHandoff
from conveyor.engine.outputs import RequestOutput
from conveyor.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# A decode node that refuses with one of these is skipped for the next candidate (a decode node of
# another model among --decode-peers refuses with WRONG_MODEL).
_RETRYABLE_DECODE_CODES = {"overloaded", "unavailable", WRONG_MODEL}


def parse_allowlist(text: str | None) -> set[tuple[str, int]] | None:
    """Numeric IP:port entries; hostnames are skipped with a warning. None = unset (permissive)."""
    if text is None:
        return None
    allowed = set()
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        try:
            numeric = transport.numeric_address(entry)
        except ValueError:
            numeric = None
        if numeric is None:
            logger.warning("decode allowlist: %r is not a numeric IP:port; skipped (names are not resolved)", entry)
            continue
        allowed.add(numeric)
    return allowed


@dataclass
class PrefillStats:
    num_requests: int = 0
    num_handoffs: int = 0
    num_finished_at_first_token: int = 0
    num_decode_failovers: int = 0  # the named decode node was unreachable; a --decode-peers one took it
    num_decode_lost: int = 0  # streams ended by a decode node dying mid-stream
    num_cancelled: int = 0
    handoff_bytes: int = 0
    handoff_tokens: int = 0
    handoff_seconds: float = 0.0  # KV frame encode + send + the decode node's first answer
    by_decode: dict[str, int] = field(default_factory=dict)


class PrefillNode(FrameServer):
    role = "prefill"

    def __init__(self, engine: AsyncEngine, config: ClusterConfig, models: Sequence[str] = (),
                 http_address: str | None = None) -> None:
        super().__init__(config.serving_bind or "", models, http_address, image_marker_of(engine.core))
        self.engine = engine
        self.core = engine.core
        self.decode_peers = config.decode_peer_list
        self.allowlist = parse_allowlist(config.decode_allowlist)
        if self.allowlist is None:
            logger.warning("prefill node: CONVEYOR_DECODE_ALLOWLIST is unset, so any decode_target a router "
                           "names is accepted (set it to the decode pool's IP:port list to restrict)")
        self._round_robin = itertools.count()
        self.stats = PrefillStats()

    async def handle(self, frame: Frame, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not isinstance(frame, GenerateFrame):
            raise refuse(400, f"a prefill node expects a generate frame, got {type(frame).__name__}", "bad_frame")
        if not self.serves(frame.model):
            raise self.wrong_model(frame.model)
        self.stats.num_requests += 1
        targets = self._decode_targets(frame.decode_target)
        core = self.core
        max_tokens = frame.sampling.max_tokens
        if max_tokens is None:  # as many as the context window leaves, as on a single node
            max_tokens = max(core.max_model_len - len(frame.prompt_token_ids), 1)
        try:
            params = to_sampling_params(frame.sampling, max_tokens)
        except InvalidRequestError as exc:
            raise refuse(400, str(exc), "invalid_request", exc.param) from None
        await compile_grammar(core, params)
        try:  # images: hashed, then resized and normalized by the family's processor, off the event loop
            images = await asyncio.to_thread(images_from_wire, frame.images) if frame.images else []
        except ValueError as exc:
            raise refuse(400, str(exc), "invalid_request", "messages") from None
        make = functools.partial(core.make_request, frame.prompt_token_ids, params, frame.request_id,
                                 priority=frame.priority, cache_prompt=frame.cache_prompt, images=images)
        try:
            request = await asyncio.to_thread(make) if images else make()
        except InvalidRequestError as exc:
            raise refuse(400, str(exc), "invalid_request", exc.param) from None
        core.kv_transfer.mark_for_handoff(request.request_id)
        try:
            stream = self.engine.submit(request)
        except QueueFullError as exc:
            core.kv_transfer.forget(request.request_id)
            raise refuse(503, f"prefill node busy: {exc}", "overloaded") from None
        except EngineDeadError as exc:
            core.kv_transfer.forget(request.request_id)
            raise refuse(503, f"prefill engine stopped: {exc}", "unavailable") from None
        if await run_unless_closed(self._pipeline(request.request_id, stream, targets, writer), reader):
            self.stats.num_cancelled += 1

    def _decode_targets(self, named: str | None) -> list[str]:
        """The router's choice first (if allowed), then the configured peers as fallbacks."""
        if named is not None:
            try:
                numeric = transport.numeric_address(named)
            except ValueError:
                raise refuse(400, f"decode_target {named!r} is not host:port", "invalid_request",
                             "decode_target") from None
            if self.allowlist is not None and numeric not in self.allowlist:
                raise refuse(403, f"decode_target {named} is not in the decode allowlist", "forbidden",
                             "decode_target")
            return [named] + [p for p in self.decode_peers if p != named]
        if not self.decode_peers:
            raise refuse(503, "no decode_target in the request and no --decode-peers configured", "unavailable")
        start = next(self._round_robin) % len(self.decode_peers)
        return self.decode_peers[start:] + self.decode_peers[:start]

    async def _pipeline(self, request_id: str, stream: asyncio.Queue[RequestOutput], targets: list[str],
                        writer: asyncio.StreamWriter) -> None:
        done = False
        try:
            out = await stream.get()
            if out.kv_handoff is None:  # finished at its first token, or failed: nothing to hand off
                done = True
                self.stats.num_finished_at_first_token += 1
                await transport.write_frame(writer, token_frame(out, "prefill"))
                return
            done = True  # the engine has let go of it
            handoff: KVHandoff = out.kv_handoff  # type: ignore[assignment]
            await transport.write_frame(writer, token_frame(out, "prefill", finished=False))
            await self._relay(handoff, targets, writer)
        finally:
            if not done:
                self.engine.abort(request_id)

    async def _relay(self, handoff: KVHandoff, targets: list[str], writer: asyncio.StreamWriter) -> None:
        request = handoff.request
        frame = handoff_frame(handoff, self.models[0] if self.models else None)
        opened = await self._open_decode(frame, targets)
        if isinstance(opened, str):
            await transport.write_frame(writer, error_token_frame(request.request_id, opened, DECODE_LOST))
            return
        address, reader, decode_writer, first = opened
        try:
            reply: Frame = first
            while True:
                if isinstance(reply, ErrorFrame):
                    await transport.write_frame(writer, error_token_frame(request.request_id, reply.message))
                    return
                if not isinstance(reply, TokenFrame):
                    raise WireError(f"unexpected {type(reply).__name__} from the decode node")
                await transport.write_frame(writer, reply)
                if reply.finished:
                    return
                reply = await transport.read_frame(reader)
        except (PeerClosed, WireError, *_TRANSPORT_ERRORS) as exc:
            if writer.is_closing():
                raise
            self.stats.num_decode_lost += 1
            logger.warning("prefill node: decode node %s lost mid-stream (%s)", address, exc or type(exc).__name__)
            await transport.write_frame(writer, error_token_frame(
                request.request_id, f"decode node {address} failed mid-stream: {exc or type(exc).__name__}",
                DECODE_LOST))
        finally:
            transport.close(decode_writer)

    async def _open_decode(self, frame: HandoffFrame, targets: list[str]):
        """Send the handoff to the first target that takes it: (address, reader, writer, first reply),
        or an error message when none does."""
        encoded_at = asyncio.get_running_loop().time()
        errors = []
        for i, address in enumerate(targets):
            writer = None
            try:
                reader, writer = await transport.connect(address)
                await transport.write_frame(writer, frame)
                first = await transport.read_frame(reader)
            except (PeerClosed, WireError, *_TRANSPORT_ERRORS) as exc:
                transport.close(writer)
                errors.append(f"{address}: {exc or type(exc).__name__}")
                continue
            if isinstance(first, ErrorFrame) and first.code in _RETRYABLE_DECODE_CODES:
                transport.close(writer)
                errors.append(f"{address}: {first.message}")
                continue
            stats = self.stats
            stats.num_handoffs += 1
            stats.num_decode_failovers += 1 if i else 0
            stats.handoff_bytes += len(frame.kv.data)
            stats.handoff_tokens += frame.kv.num_tokens
            stats.handoff_seconds += asyncio.get_running_loop().time() - encoded_at
            stats.by_decode[address] = stats.by_decode.get(address, 0) + 1
            return address, reader, writer, first
        return "no decode node took the handoff (" + "; ".join(errors) + ")"


def handoff_frame(handoff: KVHandoff, model: str | None) -> HandoffFrame:
    """The sequence after its first token, for a decode node: tokens (the expanded prompt), sampling, KV, generator,
    and an image sequence's spans, tower rows and rotary positions (cluster/images.py)."""
    request = handoff.request
    rope = [list(axis) for axis in request.rope_positions] if request.rope_positions is not None else None
    return HandoffFrame(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                        output_token_ids=request.output_token_ids, sampling=to_wire(request.sampling_params),
                        kv=KVPayload(**vars(handoff.kv)), priority=request.priority, cache_prompt=request.cache_prompt,
                        num_cached_tokens=request.num_cached_tokens, rng_state=handoff.rng_state, model=model,
                        images=spans_to_wire(request.images, handoff.image_rows), rope_positions=rope,
                        rope_delta=request.rope_delta)


def token_frame(out: RequestOutput, node: str, finished: bool | None = None) -> TokenFrame:
    done = out.finished if finished is None else finished
    return TokenFrame(request_id=out.request_id, token_ids=list(out.new_token_ids), text=out.new_text, finished=done,
                      finish_reason=out.finish_reason if done else None, num_prompt_tokens=out.num_prompt_tokens,
                      num_output_tokens=out.num_output_tokens, num_cached_tokens=out.num_cached_tokens,
                      error=out.error, node=node, logprobs=logprobs_to_wire(out.logprobs),
                      stop_sequence=out.stop_sequence if done else None)


def error_token_frame(request_id: str, message: str, code: str | None = None) -> TokenFrame:
    return TokenFrame(request_id=request_id, token_ids=[], text="", finished=True, finish_reason="error",
                      error=message, node="prefill", error_code=code)
