"""Shared by the agent-API tests: the raw SSE stream as its clients see it."""

from __future__ import annotations

import json

import httpx


def named_events(url: str, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """POST a streamed request; the SSE events as (event name, data), each data's type equal to its name."""
    events = []
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers or {}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == name
                events.append((name, data))
    return events
