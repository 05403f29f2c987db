"""asyncio TCP streams carrying wire frames: one connection per request and hop.

A connection per request keeps cancellation trivial: closing it is the cancel, on every hop
(router -> prefill -> decode), and a peer that dies shows up as EOF or a reset on exactly
the requests it was serving.
"""

from __future__ import annotations

import asyncio
import ipaddress

from conveyor.cluster import wire
from conveyor.cluster.wire import Frame, WireError

CONNECT_TIMEOUT_S = 2.0
WILDCARD_HOSTS = ("0.0.0.0", "::")  # bind-all: a listener's address, never one to dial
STREAM_LIMIT = 16 << 20  # read-buffer high-water mark; a handoff frame is MBs, fewer pause/resume rounds


class PeerClosed(ConnectionError):
    """The peer closed the connection cleanly between frames."""


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' (or '[v6]:port') -> (host, port); ValueError when malformed."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    """(host, port) -> 'host:port' ('[v6]:port' for an IPv6 host), as parse_address reads it back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def reachable_address(address: str, peer: str) -> str:
    """`address` as a peer dials it: a wildcard host (a node's --host 0.0.0.0 or ::) is reached at the
    host the peer already reaches that node by (its serving address, `peer`)."""
    host, port = parse_address(address)
    if host in WILDCARD_HOSTS:
        host = parse_address(peer)[0]
    return join_address(host, port)


def numeric_address(address: str) -> tuple[str, int] | None:
    """(ip, port) for a numeric IP:port, None for a hostname (allowlists do not resolve names)."""
    host, port = parse_address(address)
    try:
        return str(ipaddress.ip_address(host)), port
    except ValueError:
        return None


async def connect(address: str, timeout: float = CONNECT_TIMEOUT_S) -> tuple[asyncio.StreamReader,
                                                                                asyncio.StreamWriter]:
    host, port = parse_address(address)
    return await asyncio.wait_for(asyncio.open_connection(host, port, limit=STREAM_LIMIT), timeout)


async def read_frame(reader: asyncio.StreamReader) -> Frame:
    """The next frame; PeerClosed on a clean EOF before a header, WireError on a bad frame,
    asyncio.IncompleteReadError / ConnectionError when the peer vanished mid-frame."""
    try:
        header = await reader.readexactly(wire.HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise PeerClosed("peer closed the connection") from None
        raise WireError("truncated frame header") from None
    length = wire.parse_header(header)
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise WireError(f"truncated frame: expected {length} bytes") from None
    return wire.decode(body)


async def write_frame(writer: asyncio.StreamWriter, frame: Frame) -> None:
    writer.write(wire.encode(frame))
    await writer.drain()


def close(writer: asyncio.StreamWriter | None) -> None:
    if writer is not None and not writer.is_closing():
        writer.close()
