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


def fuzzed_statuses(url: str, base: dict, paths: list[list], rng, rounds: int = 60) -> list[tuple[int, dict]]:
    """POST `rounds` copies of `base`, each with one field (a path in `paths`) set to a junk value; never a 5xx.
    Returns each answer's (status, JSON body) for the API's own checks of its error shape."""
    junk = [None, 0, -1, 1.5, "", "x", [], {}, [1], {"type": "text"}, True, 10**12]
    answers = []
    for _ in range(rounds):
        body = json.loads(json.dumps(base))
        path = rng.choice(paths)
        target = body
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = rng.choice(junk)
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code < 500, (body, r.text)
        answers.append((r.status_code, r.json()))
    return answers
