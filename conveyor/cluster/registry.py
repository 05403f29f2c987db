"""The router's view of its two pools: which nodes are online, round-robin choice, counts.

Round-robin over the nodes currently online: the router has no live per-node load
telemetry, so spreading evenly is the honest strategy. A node leaves the rotation when a
dispatch to it fails or the health monitor cannot connect, and rejoins when a probe succeeds.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


class NodeStatus(str, enum.Enum):
    ONLINE = "online"
    UNREACHABLE = "unreachable"


@dataclass
class Node:
    address: str
    role: str  # "prefill" | "decode"
    status: NodeStatus = NodeStatus.ONLINE
    num_dispatched: int = 0
    num_in_flight: int = 0
    num_failures: int = 0  # dispatches that failed on transport
    num_marked_unreachable: int = 0
    last_error: str | None = None
    last_change: float = field(default_factory=time.time)

    @property
    def online(self) -> bool:
        return self.status == NodeStatus.ONLINE

    def view(self) -> dict:
        return {"address": self.address, "status": self.status.value, "dispatched": self.num_dispatched,
                "in_flight": self.num_in_flight, "failures": self.num_failures,
                "times_marked_unreachable": self.num_marked_unreachable, "last_error": self.last_error,
                "status_since": round(self.last_change, 3)}


class Pool:
    def __init__(self, role: str, addresses: Iterable[str]) -> None:
        self.role = role
        self.nodes = [Node(address, role) for address in addresses]
        self._next = 0

    def online(self) -> list[Node]:
        return [n for n in self.nodes if n.online]

    def pick(self, exclude: Iterable[Node] = ()) -> Node | None:
        """The next online node in rotation, skipping `exclude`; None when there is none."""
        skip = {id(n) for n in exclude}
        for offset in range(len(self.nodes)):
            node = self.nodes[(self._next + offset) % len(self.nodes)]
            if node.online and id(node) not in skip:
                self._next = (self._next + offset + 1) % len(self.nodes)
                return node
        return None

    def mark_unreachable(self, node: Node, reason: str) -> None:
        node.last_error = reason
        if node.online:
            node.status = NodeStatus.UNREACHABLE
            node.num_marked_unreachable += 1
            node.last_change = time.time()
            logger.warning("router: %s node %s unreachable: %s", self.role, node.address, reason)

    def mark_online(self, node: Node) -> None:
        if not node.online:
            node.status = NodeStatus.ONLINE
            node.last_change = time.time()
            logger.info("router: %s node %s is back online", self.role, node.address)


@dataclass
class RoutingStats:
    num_requests: int = 0
    num_completed: int = 0
    num_failed: int = 0  # ended with an error (a 4xx/5xx before the response, or an error event)
    num_retries: int = 0  # attempts moved to another prefill node after a transport error or refusal
    num_rejected_no_prefill: int = 0
    num_rejected_no_decode: int = 0
    num_rejected_overloaded: int = 0
    num_cancelled: int = 0  # the client left first

    def view(self) -> dict:
        return {name.removeprefix("num_"): value for name, value in vars(self).items()}


class Registry:
    def __init__(self, prefill: Iterable[str], decode: Iterable[str]) -> None:
        self.prefill = Pool("prefill", prefill)
        self.decode = Pool("decode", decode)
        self.stats = RoutingStats()

    def pools(self) -> tuple[Pool, Pool]:
        return self.prefill, self.decode

    def view(self) -> dict:
        return {
            "prefill": [n.view() for n in self.prefill.nodes],
            "decode": [n.view() for n in self.decode.nodes],
            "dispatch_counts": {"prefill": {n.address: n.num_dispatched for n in self.prefill.nodes},
                                "decode": {n.address: n.num_dispatched for n in self.decode.nodes}},
            "routing": self.stats.view(),
        }
