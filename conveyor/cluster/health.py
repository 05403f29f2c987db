"""The router's background health monitor: a TCP connect to every peer's serving address, and on
that connection the question which models the node serves (InfoFrame -> NodeInfoFrame: the ids
its GET /v1/models lists, and where its HTTP API listens), kept in the registry.

It covers the decode pool too, which the router never dials for requests (the prefill
nodes do): a decode node that stops accepting leaves the rotation before a prefill node
wastes a handoff on it, and comes back when it accepts again. A node that accepts but does
not answer the question (an older node) is online and keeps what it said before, if anything.
"""

from __future__ import annotations

import asyncio
import contextlib

from conveyor.cluster import transport
from conveyor.cluster.node import _TRANSPORT_ERRORS
from conveyor.cluster.registry import Node, Pool, Registry
from conveyor.cluster.transport import PeerClosed
from conveyor.cluster.wire import InfoFrame, NodeInfoFrame, WireError

PROBE_TIMEOUT_S = 1.0
# A node whose connect times out this many probes in a row leaves the rotation; a refused connect (nothing
# listens: the node is gone) takes it out at once. One slow connect on a busy machine is not a dead node.
PROBE_TIMEOUTS_TO_UNREACHABLE = 3


class HealthMonitor:
    def __init__(self, registry: Registry, interval: float, timeout: float = PROBE_TIMEOUT_S) -> None:
        self.registry = registry
        self.interval = interval
        self.timeout = min(timeout, interval)
        self.num_rounds = 0
        self._timeouts: dict[str, int] = {}  # node address -> connects timed out in a row
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(pool, node) for pool in self.registry.pools() for node in pool.nodes))
        self.num_rounds += 1

    async def _run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval)

    async def _probe(self, pool: Pool, node: Node) -> None:
        try:
            reader, writer = await transport.connect(node.address, self.timeout)
        except asyncio.TimeoutError:
            self._timeouts[node.address] = self._timeouts.get(node.address, 0) + 1
            if self._timeouts[node.address] >= PROBE_TIMEOUTS_TO_UNREACHABLE or not node.online:
                pool.mark_unreachable(node, f"health probe: connect timed out {self._timeouts[node.address]} "
                                            "time(s) in a row")
            return
        except (OSError, ValueError) as exc:
            pool.mark_unreachable(node, f"health probe: {exc or type(exc).__name__}")
            return
        self._timeouts.pop(node.address, None)
        try:
            await transport.write_frame(writer, InfoFrame())
            answer = await asyncio.wait_for(transport.read_frame(reader), self.timeout)
            if isinstance(answer, NodeInfoFrame):
                pool.set_models(node, answer.models)  # before it (re)joins the rotation
                pool.set_http_address(node, answer.http_address)
                node.image_marker = answer.image_marker
        except (PeerClosed, WireError, *_TRANSPORT_ERRORS):
            pass  # accepting is what makes it online
        finally:
            transport.close(writer)
        pool.mark_online(node)
