"""Decode role: take a KV handoff into this engine's pool, decode it in the continuous batch
with every other row, and stream the continuation back on the handoff's connection.

Closing that connection (prefill node gone, router cancelled) aborts the request here and
frees its blocks on the next tick.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.cluster import transport
from conveyor.cluster.images import rope_from_wire, spans_from_wire
from conveyor.cluster.transport import numeric_address
from conveyor.cluster.node import FrameServer, compile_grammar, image_marker_of, refuse, run_unless_closed, \
    to_sampling_params
from conveyor.cluster.prefill import token_frame
from conveyor.cluster.wire import Frame, HandoffFrame
from conveyor.config import ClusterConfig
from conveyor.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from conveyor.engine.kv_transfer import KVBlob
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.request import Request
from conveyor.errors import InvalidRequestError

logger = logging.getLogger(__name__)


@dataclass
class DecodeStats:
    num_handoffs: int = 0
    num_refused: int = 0
    num_cancelled: int = 0
    received_bytes: int = 0


class DecodeNode(FrameServer):
    role = "decode"

    def __init__(self, engine: AsyncEngine, config: ClusterConfig, models: Sequence[str] = (),
                 http_address: str | None = None) -> None:
        super().__init__(config.serving_bind or "", models, http_address, image_marker_of(engine.core))
        self.engine = engine
        self.core = engine.core
        self.stats = DecodeStats()
        self.accepted_hosts = _numeric_hosts(config.prefill_peer_list)

    async def handle(self, frame: Frame, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not isinstance(frame, HandoffFrame):
            raise refuse(400, f"a decode node expects a handoff frame, got {type(frame).__name__}", "bad_frame")
        peer = (writer.get_extra_info("peername") or ("?",))[0]
        if self.accepted_hosts is not None and peer not in self.accepted_hosts:
            self.stats.num_refused += 1
            raise refuse(403, f"handoffs from {peer} are not accepted (not in --prefill-peers)", "forbidden")
        if not self.serves(frame.model):  # another model's KV may even fit this pool's layout: never import it
            self.stats.num_refused += 1
            raise self.wrong_model(frame.model)
        core = self.core
        blob = KVBlob(**{name: getattr(frame.kv, name) for name in frame.kv.__struct_fields__})
        try:
            request = await self._request(frame, blob)
        except InvalidRequestError as exc:
            self.stats.num_refused += 1
            raise refuse(400, str(exc), "invalid_request", exc.param) from None
        except ValueError as exc:
            self.stats.num_refused += 1
            raise refuse(400, f"bad handoff: {exc}", "invalid_request") from None
        try:
            stream = self.engine.submit(request)
        except (QueueFullError, EngineDeadError) as exc:
            core.kv_transfer.forget(request.request_id)
            self.stats.num_refused += 1
            code = "overloaded" if isinstance(exc, QueueFullError) else "unavailable"
            raise refuse(503, f"decode node cannot take it: {exc}", code) from None
        self.stats.num_handoffs += 1
        self.stats.received_bytes += len(blob.data)
        if await run_unless_closed(self._stream(request.request_id, stream, writer), reader):
            self.stats.num_cancelled += 1

    async def _request(self, frame: HandoffFrame, blob: KVBlob) -> Request:
        """The handed-off sequence as this engine's request, at the state the prefill node left it in:
        its first token(s) appended (its grammar advanced past them), its KV staged for import."""
        core = self.core
        if not frame.output_token_ids:
            raise ValueError("a handoff carries at least the first token")
        core.kv_transfer.check_layout(blob)
        if frame.sampling.max_tokens is None:
            raise ValueError("a handoff carries its max_tokens")
        params = to_sampling_params(frame.sampling, frame.sampling.max_tokens)
        await compile_grammar(core, params)
        request = core.make_request(frame.prompt_token_ids, params, frame.request_id, priority=frame.priority,
                                    cache_prompt=frame.cache_prompt)
        if frame.images:  # the prompt is the expanded one: its images' spans, hashes and tower rows ride along
            if core.vision is None:
                raise InvalidRequestError(f"{core.model_name} does not accept images (a text-only model)", "messages")
            width = core.vision.row_width(core.model_config.hidden_size)
            request.images = spans_from_wire(frame.images, len(frame.prompt_token_ids), width, core.dtype, core.device)
            request.cache_prompt = request.cache_prompt and core.config.vlm_prefix_cache
        request.rope_positions = rope_from_wire(frame.rope_positions, len(frame.prompt_token_ids))
        request.rope_delta = frame.rope_delta
        for token in frame.output_token_ids:
            request.append_output_token(token)
        if request.error is not None:  # the prefill node's masks allowed it: a different grammar here
            raise ValueError(request.error)
        request.num_cached_tokens = frame.num_cached_tokens
        core.kv_transfer.stage_import(request, blob, frame.rng_state)
        return request

    async def _stream(self, request_id: str, stream: asyncio.Queue[RequestOutput],
                      writer: asyncio.StreamWriter) -> None:
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                if out.new_text or out.new_token_ids or finished:
                    await transport.write_frame(writer, token_frame(out, "decode"))
        finally:
            if not finished:
                self.engine.abort(request_id)


def _numeric_hosts(peers: list[str]) -> set[str] | None:
    """Hosts handoffs are accepted from; None (accept any) when unset or when a peer is a hostname."""
    if not peers:
        return None
    hosts = set()
    for peer in peers:
        numeric = numeric_address(peer)
        if numeric is None:
            logger.warning("decode node: --prefill-peers entry %r is not a numeric IP:port; accepting handoffs "
                           "from any host", peer)
            return None
        hosts.add(numeric[0])
    return hosts
