"""The router's view of its two pools: which nodes are online, which models each serves,
round-robin choice, counts.

Round-robin over the nodes currently online that serve the request's model: the router has no
live per-node load telemetry, so spreading evenly is the honest strategy. A node leaves the
rotation when a dispatch to it fails or the health monitor cannot connect, and rejoins when a
probe succeeds. Each probe also asks the node for its models (health.py); a node that has not
said (an older node) is taken to serve the router's default model, as every node was before.
The probe also learns where each node's own HTTP API listens: pooling requests (embeddings,
rerank, score) go there (forward.py), to the node of the model with the fewest in flight.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from conveyor.cluster.transport import reachable_address

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
    models: tuple[str, ...] | None = None  # the ids its GET /v1/models lists; None: not said (yet)
    http_address: str | None = None  # host:port of its own HTTP API, as the router dials it; None: not said
    image_marker: str | None = None  # its vision model's image marker text (None: no tower, or not said)

    @property
    def online(self) -> bool:
        return self.status == NodeStatus.ONLINE

    def view(self) -> dict:
        return {"address": self.address, "status": self.status.value, "dispatched": self.num_dispatched,
                "in_flight": self.num_in_flight, "failures": self.num_failures,
                "times_marked_unreachable": self.num_marked_unreachable, "last_error": self.last_error,
                "status_since": round(self.last_change, 3),
                "models": list(self.models) if self.models is not None else None,
                "http_address": self.http_address}


class Pool:
    def __init__(self, role: str, addresses: Iterable[str], default_model: str | None = None) -> None:
        self.role = role
        self.nodes = [Node(address, role) for address in addresses]
        self.default_model = default_model
        self._next = 0

    def serves(self, node: Node, model: str | None) -> bool:
        """model None: any node will do. A node that has not said serves the default model (any, without one)."""
        if model is None:
            return True
        if node.models is None:
            return self.default_model is None or model == self.default_model
        return model in node.models

    def online(self, model: str | None = None) -> list[Node]:
        return [n for n in self.nodes if n.online and self.serves(n, model)]

    def pick(self, exclude: Iterable[Node] = (), model: str | None = None) -> Node | None:
        """The next online node in rotation that serves `model`, skipping `exclude`; None when there is none."""
        skip = {id(n) for n in exclude}
        for offset in range(len(self.nodes)):
            node = self.nodes[(self._next + offset) % len(self.nodes)]
            if node.online and id(node) not in skip and self.serves(node, model):
                self._next = (self._next + offset + 1) % len(self.nodes)
                return node
        return None

    def set_models(self, node: Node, models: Iterable[str]) -> None:
        models = tuple(models)
        if models != node.models:
            logger.info("router: %s node %s serves %s", self.role, node.address, ", ".join(models) or "no model")
            node.models = models

    def set_http_address(self, node: Node, address: str | None) -> None:
        """`address`: the node's --host:--port as it said it (a wildcard host is dialed at its serving host)."""
        try:
            node.http_address = reachable_address(address, node.address) if address is not None else None
        except ValueError:
            logger.warning("router: %s node %s said a malformed HTTP address %r", self.role, node.address, address)
            node.http_address = None

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
    num_forwarded: int = 0  # of the requests, embeddings / rerank / score sent to a node's HTTP API (forward.py)

    def view(self) -> dict:
        return {name.removeprefix("num_"): value for name, value in vars(self).items()}


class Registry:
    def __init__(self, prefill: Iterable[str], decode: Iterable[str], default_model: str | None = None) -> None:
        self.prefill = Pool("prefill", prefill, default_model)
        self.decode = Pool("decode", decode, default_model)
        self.stats = RoutingStats()

    def pools(self) -> tuple[Pool, Pool]:
        return self.prefill, self.decode

    def models(self) -> dict[str, dict[str, list[str]]]:
        """Each model an online node serves -> the addresses serving it, by role (in pool order)."""
        served: dict[str, dict[str, list[str]]] = {}
        for pool in self.pools():
            for node in pool.online():
                names = node.models if node.models is not None else (pool.default_model,)
                for name in filter(None, names):
                    served.setdefault(name, {"prefill": [], "decode": []})[pool.role].append(node.address)
        return served

    def view(self) -> dict:
        return {
            "prefill": [n.view() for n in self.prefill.nodes],
            "decode": [n.view() for n in self.decode.nodes],
            "dispatch_counts": {"prefill": {n.address: n.num_dispatched for n in self.prefill.nodes},
                                "decode": {n.address: n.num_dispatched for n in self.decode.nodes}},
            "models": self.models(),
            "routing": self.stats.view(),
        }
