"""Real `conveyor serve` processes on free loopback ports: single nodes, prefill/decode nodes, a router."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx


_HANDED_OUT: set[int] = set()  # ports given to a process in this test run (never handed out twice)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port for a child process to bind later: below the kernel's ephemeral range, so no outbound
    connection of the test run can take it meanwhile (a bind(0) port could: seen as "address already
    in use" at a node's start), free now, and not handed out before in this run."""
    rng = random.Random()
    high = _ephemeral_low()
    for _ in range(1000):
        port = rng.randrange(20000, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free loopback port below the ephemeral range")


@dataclass
class Proc:
    name: str
    port: int
    serving: str | None
    popen: subprocess.Popen
    log_path: str
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill9(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(timeout=10)

    def stop(self) -> None:
        self.kill9()  # teardown only: graceful shutdown is tested elsewhere (tests/server/test_lifecycle.py)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]


def start(name: str, model: str | None, log_dir: str, role: str | None = None, extra: list[str] = (),
          env: dict[str, str] | None = None, serving: bool = True) -> Proc:
    port = free_port()
    args = [sys.executable, "-m", "conveyor.cli", "serve", "--port", str(port), "--threads", "1"]
    if model is not None:
        args += ["--model", model]
    bind = None
    if role is not None:
        args += ["--node-role", role]
        if serving:
            bind = f"127.0.0.1:{free_port()}"
            args += ["--serving-bind", bind]
    args += list(extra)
    log_path = os.path.join(log_dir, f"{name}.log")
    process_env = {**os.environ, "CONVEYOR_DEVICE": os.environ.get("CONVEYOR_DEVICE", "cpu"), **(env or {})}
    with open(log_path, "w") as log:
        popen = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=process_env,
                                 start_new_session=True)
    return Proc(name, port, bind, popen, log_path, args)


def wait_healthy(procs: list[Proc], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for proc in list(pending):
            assert proc.alive(), f"{proc.name} exited early:\n{proc.log()}"
            try:
                if httpx.get(f"{proc.url}/health", timeout=2).status_code == 200:
                    pending.remove(proc)
            except httpx.HTTPError:
                pass
        assert time.monotonic() < deadline, f"not healthy in time: {[p.name for p in pending]}"
        time.sleep(0.2)


def wait_for(predicate, timeout: float, what: str) -> float:
    """Seconds it took; fails after timeout."""
    start_time = time.monotonic()
    while not predicate():
        assert time.monotonic() - start_time < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - start_time


def call(base: str, path: str, body: dict) -> dict:
    """text, finish_reason and usage of one request, streamed or not."""
    with httpx.Client(base_url=base, timeout=60) as client:
        if not body.get("stream"):
            r = client.post(path, json=body)
            assert r.status_code == 200, r.text
            data = r.json()
            choice = data["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            return {"text": text, "finish_reason": choice["finish_reason"], "usage": _usage(data["usage"])}
        text, finish, usage = "", None, None
        with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event.get("usage"):
                    usage = _usage(event["usage"])
                for choice in event["choices"]:
                    text += choice.get("delta", {}).get("content", "") if "delta" in choice else choice["text"]
                    finish = choice["finish_reason"] or finish
        return {"text": text, "finish_reason": finish, "usage": usage}


def _usage(usage: dict) -> dict:
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def metric_sample(client, name: str, **labels: str) -> float:
    """The value of the first /metrics sample called `name` whose labels include `labels` (0 when none): `client`
    is anything with .get(path) (a TestClient of the router, an httpx.Client)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
