"""Cost of the request-limit checks (server/limits.py) against plain json.loads, interleaved A/B.

  .venv/bin/python benchmarks/request_limits.py
"""

from __future__ import annotations

import json
import statistics
import time

from conveyor.server.limits import RequestLimits, parse_json

BODIES = {
    "chat, 1 short message": {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 32},
    "chat, 200 messages x 500 chars": {"messages": [{"role": "user", "content": "x" * 500}] * 200},
    "completion, 900 KB prompt": {"prompt": "lorem ipsum " * 75_000, "max_tokens": 8},
    "completion, 8 x 2048 token ids": {"prompt": [[17] * 2048] * 8, "max_tokens": 8},
}


def _time(fn, raw: bytes, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn(raw)
    return (time.perf_counter() - start) / repeat * 1e6  # microseconds


def main() -> None:
    limits = RequestLimits()
    print("| body | bytes | json.loads us | parse_json (limits) us | overhead |")
    print("|---|---|---|---|---|")
    for name, body in BODIES.items():
        raw = json.dumps(body).encode()
        repeat = max(3, int(2e6 // len(raw)))
        plain, checked = [], []
        for _ in range(7):  # interleaved, so shared-machine noise hits both alike
            plain.append(_time(json.loads, raw, repeat))
            checked.append(_time(lambda r: parse_json(r, limits), raw, repeat))
        a, b = statistics.median(plain), statistics.median(checked)
        print(f"| {name} | {len(raw)} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
