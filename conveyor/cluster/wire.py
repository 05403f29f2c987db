"""The frames nodes exchange: msgspec structs as MessagePack, behind a fixed header.

    0      4        5        9
    | CNVY | version | length | body (length bytes of MessagePack) |

A frame whose magic, version or length is wrong, or whose body does not decode into one of
the known frame types, raises WireError; the node answers with an ErrorFrame and closes.
"""

from __future__ import annotations

import struct
from typing import Literal

import msgspec

MAGIC = b"CNVY"
# 2: TokenFrame.stop_sequence; 3: InfoFrame / NodeInfoFrame and the model a generate or handoff frame is for;
# 4: NodeInfoFrame.http_address; 5: images (GenerateFrame.images, HandoffFrame.images and rotary fields,
# NodeInfoFrame.image_marker). Frames refuse unknown fields, so peers must agree.
VERSION = 5
HEADER = struct.Struct(">4sBI")  # magic, version, body length
MAX_FRAME_BYTES = 1 << 30
# TokenFrame.error_code when the stream's decode side is gone (no decode node took the handoff, or it
# died mid-stream): the router may rerun a greedy or seeded request on another decode node.
DECODE_LOST = "decode_lost"  # a 1 GiB handoff is ~45k SmolLM2 tokens of KV; beyond that is a bug
# ErrorFrame.code of a node asked for a model it does not serve: the sender tries another node.
WRONG_MODEL = "wrong_model"


class WireError(ValueError):
    """A malformed, truncated, oversized or unknown frame."""


class GrammarWire(msgspec.Struct, forbid_unknown_fields=True):
    """A GrammarSpec (structured/grammar.py): each node compiles it against its own vocabulary."""

    kind: Literal["json_schema", "json_object", "regex", "lark", "choice"]
    source: str


class SamplingWire(msgspec.Struct, forbid_unknown_fields=True):
    """SamplingParams on the wire; max_tokens None = what the worker's context window leaves."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # None = off; k = the chosen token plus k alternatives
    grammar: GrammarWire | None = None  # response_format / guided_* / a forced tool call


class ImageWire(msgspec.Struct, forbid_unknown_fields=True):
    """One image of a routed request as the router decoded and checked it (ImageInput): RGB rows, width x height x 3
    bytes. The prefill node hashes it itself and runs its own processor and tower on it."""

    width: int
    height: int
    rgb: bytes


class ImageSpanWire(msgspec.Struct, forbid_unknown_fields=True):
    """One image of a handed-off sequence: its place in the expanded prompt (an ImageItem without pixels; its hash
    keys the blocks it overlaps) and the tower's output rows, (num_embeds, hidden) in `dtype`, so a decode node that
    re-prefills the sequence (no free block at arrival, a preemption) needs neither pixels nor a tower run."""

    content_hash: str
    offset: int
    num_tokens: int
    embed_runs: list[tuple[int, int]]
    rows: bytes
    dtype: str
    hidden: int
    bidirectional: bool = False


class GenerateFrame(msgspec.Struct, tag="generate", forbid_unknown_fields=True):
    """Router -> prefill node: one request. decode_target is optional (absent: --decode-peers); model is the
    id the router routed it by (None: whatever the node serves)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingWire
    priority: int = 0
    cache_prompt: bool = True
    decode_target: str | None = None
    model: str | None = None
    images: list[ImageWire] = []  # one per image marker in prompt_token_ids, in order


class KVPayload(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """KV of positions [0, num_tokens): per layer K's rows then V's, in the sender's cache types (KVBlob).
    Defaults are omitted, so a bf16 payload is the bytes it was before the cache types (older nodes read it)."""

    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    data: bytes
    state: bytes = b""  # hybrid models: the recurrent state after those tokens (KVBlob.state)
    cache_type_k: str = "bf16"  # --cache-type-k of the sender: q8_0 rows travel as raw Q8_0 blocks
    cache_type_v: str = "bf16"
    values_in_keys: bool = False  # MLA: each layer's latent rows only (KVBlob.values_in_keys)


class HandoffFrame(msgspec.Struct, tag="handoff", forbid_unknown_fields=True):
    """Prefill -> decode node: the sequence after its first token, with its KV and sampler state."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingWire
    kv: KVPayload
    priority: int = 0
    cache_prompt: bool = True
    num_cached_tokens: int = 0
    rng_state: bytes | None = None  # the seeded request's generator after its first draw
    model: str | None = None  # the prefill node's model id: a decode node serving another refuses it
    # Image sequences: prompt_token_ids is the expanded prompt; its images; multimodal rotary (Qwen-VL) positions
    # of the prompt (t, h, w) and the delta later rows add (Request.rope_positions / rope_delta).
    images: list[ImageSpanWire] = []
    rope_positions: list[list[int]] | None = None
    rope_delta: int = 0


class LogprobWire(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A TokenLogprob (engine/outputs.py); floats travel as float64, so values arrive exact."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class TokenFrame(msgspec.Struct, tag="tokens", forbid_unknown_fields=True):
    """A delta of a request's stream; num_output_tokens is the worker's own count (exact usage)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    node: str = ""  # the role that produced it: "prefill" or "decode"
    logprobs: list[LogprobWire] = []  # one per token in token_ids, when the request asked for them
    error_code: str | None = None  # DECODE_LOST, or None
    stop_sequence: str | None = None  # the stop string that ended the request (RequestOutput.stop_sequence)


class ErrorFrame(msgspec.Struct, tag="error", forbid_unknown_fields=True):
    """A refusal before any token: status is the HTTP status the router should answer with."""

    status: int
    message: str
    code: str  # overloaded | invalid_request | bad_frame | forbidden | unavailable | wrong_model
    param: str | None = None


class InfoFrame(msgspec.Struct, tag="info", forbid_unknown_fields=True):
    """Router -> any node (the health monitor's probe): which models do you serve?"""


class NodeInfoFrame(msgspec.Struct, tag="node_info", forbid_unknown_fields=True):
    """The answer: the node's role, the model ids its own GET /v1/models lists, and where its own HTTP API
    listens (--host:--port; the router forwards embeddings, rerank and score there: cluster/forward.py)."""

    role: str
    models: list[str]
    http_address: str | None = None
    image_marker: str | None = None  # the model's image marker text (VisionProcessor.image_marker); None: no tower


Frame = GenerateFrame | HandoffFrame | TokenFrame | ErrorFrame | InfoFrame | NodeInfoFrame

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


def encode(frame: Frame) -> bytes:
    body = _encoder.encode(frame)
    if len(body) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {len(body)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return HEADER.pack(MAGIC, VERSION, len(body)) + body


def parse_header(header: bytes) -> int:
    """The body length announced by a header; WireError when it is not ours."""
    if len(header) != HEADER.size:
        raise WireError("truncated frame header")
    magic, version, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise WireError("not a conveyor frame (bad magic)")
    if version != VERSION:
        raise WireError(f"unsupported frame version {version} (this node speaks {VERSION})")
    if length > MAX_FRAME_BYTES:
        raise WireError(f"frame length {length} exceeds the {MAX_FRAME_BYTES}-byte limit")
    return length


def decode(body: bytes) -> Frame:
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"malformed frame: {exc}") from None
