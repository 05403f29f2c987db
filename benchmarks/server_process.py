"""A server for a benchmark to drive: started on a free loopback port, ready once its /health answers 200, stopped
with SIGTERM (then SIGKILL after a minute). conveyor and llama-server alike; each script builds its own command."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`cmd` must listen on `port`; its output goes to `log` (discarded without one)."""

    def __init__(self, cmd: list[str], port: int, log: Path | None = None, env: dict[str, str] | None = None,
                 timeout: float = 900.0, name: str | None = None) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.name = name or Path(cmd[0]).name
        self.log = open(log, "w") if log is not None else None
        self.proc = subprocess.Popen(cmd, stdout=self.log or subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
        where = f", see {log}" if log is not None else ""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode} while starting{where}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not answer /health within {timeout:.0f} s{where}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)

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
