"""The router serves the web page too, and its dashboard snapshot lists each node of both pools
(no processes: a bare listening socket stands in for an online node, a closed port for a dead one)."""

from __future__ import annotations

import json
import socket

from fastapi.testclient import TestClient

from conveyor.cluster.router import create_router_app
from conveyor.config import ClusterConfig, ServerConfig
from conveyor.testing import smollm_tokenizer


def test_router_page_and_snapshot_list_its_nodes():
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        online, dead = (f"127.0.0.1:{s.getsockname()[1]}" for s in (listening, closed))
        cluster = ClusterConfig(node_role="router", prefill_peers=online, decode_peers=dead, health_check_interval=60)
        app = create_router_app(smollm_tokenizer(), "m", cluster, ServerConfig(api_key="k"))
        with TestClient(app) as client:
            page = client.get("/")
            assert page.status_code == 200 and "/webui/webui.js" in page.text
            assert client.get("/v1/dashboard").status_code == 401
            auth = {"Authorization": "Bearer k"}
            snap = client.get("/v1/dashboard", headers=auth).json()
            assert snap["role"] == "router" and snap["model"] == "m"
            assert [(n["role"], n["address"], n["status"]) for n in snap["nodes"]] == [
                ("prefill", online, "online"), ("decode", dead, "unreachable")]
            assert snap["routing"]["requests"] == 0
            with client.stream("GET", "/v1/dashboard/stream", headers=auth) as r:
                first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
            assert first["nodes"] == snap["nodes"] and first["rates"]["tok_s"] is None
