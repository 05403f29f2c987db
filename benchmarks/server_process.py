"""A server for a benchmark to drive: started on a free loopback port, ready once its /health answers 200, stopped
with SIGTERM (then SIGKILL after a minute). conveyor and llama-server alike; each script builds its own command."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def sse_events(response: httpx.Response) -> AsyncIterator[dict]:
    """The JSON events of a streamed OpenAI-style response (`data: {...}` lines; `[DONE]` ends it)."""
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600.0, name: str = "server") -> None:
    """Until `url`/health answers 200: RuntimeError if `proc` exits first, TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode} while starting")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not answer /health within {timeout:.0f} s")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


class ServerProcess:
    """`cmd` must listen on `port`; its output goes to `log` (discarded without one)."""

    def __init__(self, cmd: list[str], port: int, log: Path | None = None, env: dict[str, str] | None = None,
                 timeout: float = 900.0, name: str | None = None) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.name = name or Path(cmd[0]).name
        self.log = open(log, "w") if log is not None else None
        self.proc = subprocess.Popen(cmd, stdout=self.log or subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(self.url, self.proc, timeout, self.name)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise type(exc)(f"{exc}, see {log}" if log is not None else str(exc)) from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None and not self.log.closed:
            self.log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
