"""Property-based fuzzing of the HTTP API, the CI (`--quick`) profile: no 5xx for any input.

The long profile is `python -m conveyor.fuzz --examples 3000` (see conveyor/fuzz.py).
"""

from __future__ import annotations

import httpx
import pytest

from conveyor.config import ServerConfig
from conveyor.fuzz import FUZZ_ENGINE, QUICK_EXAMPLES, check_response, run_fuzz


@pytest.fixture(scope="module")
def fuzz_server(serve_tiny):
    with serve_tiny(FUZZ_ENGINE, ServerConfig(metrics=True)) as served:
        yield served


def test_quick_fuzz_no_5xx_and_nothing_leaks(fuzz_server):
    report = run_fuzz(fuzz_server.url, QUICK_EXAMPLES, seed=0)
    assert not report.failures, "\n".join(report.failures[:10])
    assert report.num_requests >= QUICK_EXAMPLES
    assert report.statuses[200] >= 10 and sum(n for s, n in report.statuses.items() if 400 <= s < 500) >= 30
    fuzz_server.wait_until(lambda: not fuzz_server.core.has_work(), what="engine idle")
    fuzz_server.core.pool.check_integrity()
    assert fuzz_server.core.pool.stats().num_used == 0
    assert httpx.get(f"{fuzz_server.url}/health").status_code == 200


def test_the_checker_can_fail():
    """The fuzz oracle itself: a 5xx, a bad error shape or a broken stream are caught."""
    request = httpx.Request("POST", "http://x/v1/completions")
    bad = [httpx.Response(500, json={"error": {"message": "m", "type": "t", "param": None, "code": None}}),
           httpx.Response(400, json={"detail": "not openai"}),
           httpx.Response(200, json={"choices": []}),
           httpx.Response(200, text='data: {"choices": []}\n\n')]
    for response in bad:
        response.request = request
    assert check_response("/v1/completions", b"{}", bad[0], False)
    assert check_response("/v1/completions", b"{}", bad[1], False)
    assert check_response("/v1/completions", b"{}", bad[2], False)
    assert check_response("/v1/completions", b"{}", bad[3], True)
