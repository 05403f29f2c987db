"""Soak: many mixed requests at high concurrency, then prove nothing was lost or miscounted.

The mix: chat and text completions, streamed and not, n > 1, stop strings, sampling
parameters, logprobs, short and long prompts, a shared prefix, and about 20% of clients that
leave early (mid-stream, mid-prefill, or right after admission while still queued). Afterwards:

- no 5xx and no transport error; every completed response well-formed;
- the engine idle within a timeout (nothing stuck), zero live KV blocks, an intact pool;
- /metrics equals the sums over what the clients received: finished requests by reason, and
  prompt and generation tokens of the stop/length requests; every client that left is one
  `abort` per choice; conveyor_generation_tokens_total equals the per-reason sum;
- the server's RSS growth (reported, with --pid).

The soak drives a server it is given; start one first (the numbers in benchmarks/results.md are the
tiny random model's: write it with `python -c "from conveyor.testing import write_tiny_model_dir;
write_tiny_model_dir('/tmp/tiny')"`), then point the soak at it:

  python -m conveyor.cli serve --model /tmp/tiny --parallel 8 --max-queue-depth 256 --metrics --port 8090 &
  python -m conveyor.bench.soak --url http://127.0.0.1:8090 --pid $!     # 1,200 requests at concurrency 32

tests/server/test_soak.py runs the CI size (120 requests at concurrency 24) against an in-process server
and also checks the block pool's integrity.

Clients that leave only do so from streams after the 200 headers: then the client knows its
requests were admitted, and (ignore_eos, 200 tokens) that they cannot have finished by
themselves, so their `abort` count is exact.

"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

LEAVE_TOKENS = 200  # a client that leaves asked for this many, with ignore_eos: it cannot finish first
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
SHARED_PREFIX = "You are a careful assistant. " + " ".join(WORDS * 6) + " Answer briefly. "


@dataclass
class Spec:
    path: str
    body: dict
    leave: str | None = None  # None | "mid_stream" | "mid_prefill" | "queued"

    @property
    def num_choices(self) -> int:
        prompt = self.body.get("prompt")
        prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
        return self.body.get("n", 1) * prompts


@dataclass
class SoakResult:
    statuses: Counter = field(default_factory=Counter)
    finish_reasons: Counter = field(default_factory=Counter)  # over completed responses' choices
    prompt_tokens: int = 0  # per choice, as the engine counts: usage.prompt_tokens * n
    completion_tokens: int = 0
    abandoned_choices: int = 0
    leaves: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    def fail(self, message: str) -> None:
        self.failures.append(message)


def _prompt(rng: random.Random, long: bool) -> str:
    words = rng.choices(WORDS, k=rng.randint(600, 900) if long else rng.randint(3, 40))
    return " ".join(words)


def make_specs(num: int, seed: int = 0, leave_fraction: float = 0.2) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for _ in range(num):
        chat = rng.random() < 0.5
        leave = rng.choice(("mid_stream", "mid_prefill", "queued")) if rng.random() < leave_fraction else None
        long = leave == "mid_prefill" or rng.random() < 0.1
        text = _prompt(rng, long)
        if rng.random() < 0.3:
            text = SHARED_PREFIX + text  # prefix-cache sharing across requests
        body: dict = {"max_tokens": rng.randint(2, 24)}
        if chat:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
        else:
            path = "/v1/completions"
            body["prompt"] = [text, _prompt(rng, False)] if rng.random() < 0.1 and not leave else text
        body["stream"] = leave is not None or rng.random() < 0.5
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.5:
            body["temperature"] = 0.0
        else:
            body.update(temperature=rng.choice((0.5, 0.8, 1.0)), top_p=rng.choice((1.0, 0.9)),
                        top_k=rng.choice((0, 20)), min_p=rng.choice((0.0, 0.05)))
            if rng.random() < 0.5:
                body["seed"] = rng.randint(0, 2 ** 31)
        if rng.random() < 0.2:
            body["presence_penalty"] = 0.5
        if rng.random() < 0.3:
            body["stop"] = rng.choice((["a"], ["e", "o"], ["\n"], ["lima"]))
        if rng.random() < 0.15:
            body["ignore_eos"] = True
        if rng.random() < 0.1:
            if chat:
                body.update(logprobs=True, top_logprobs=2)
            else:
                body["logprobs"] = 2
        if leave is None and rng.random() < 0.25:
            body["n"] = rng.choice((2, 3))
        if leave is not None:  # cannot finish before the client leaves: its abort is certain
            body.update(max_tokens=LEAVE_TOKENS, ignore_eos=True)
            body.pop("stop", None)
        specs.append(Spec(path, body, leave))
    return specs


# -- one request -------------------------------------------------------------------------------------
async def run_one(client: httpx.AsyncClient, spec: Spec, result: SoakResult) -> None:
    try:
        if spec.body.get("stream"):
            await _run_stream(client, spec, result)
        else:
            response = await client.post(spec.path, json=spec.body)
            result.statuses[response.status_code] += 1
            if response.status_code != 200:
                result.fail(f"{response.status_code} on {spec.path}: {response.text[:200]}")
                return
            _check_full(spec, response.json(), result)
    except httpx.HTTPError as exc:
        result.fail(f"{type(exc).__name__} on {spec.path}: {exc}")


async def _run_stream(client: httpx.AsyncClient, spec: Spec, result: SoakResult) -> None:
    async with client.stream("POST", spec.path, json=spec.body) as response:
        result.statuses[response.status_code] += 1
        if response.status_code != 200:
            result.fail(f"{response.status_code} on {spec.path}: {(await response.aread())[:200]!r}")
            return
        if spec.leave in ("queued", "mid_prefill"):
            result.abandoned_choices += spec.num_choices  # admitted (200), and it cannot have finished
            result.leaves[spec.leave] += 1
            return  # leaving the block closes the connection
        events, content_chunks = [], 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if spec.leave == "mid_stream" and events[-1] != "[DONE]":
                chunk = json.loads(events[-1])
                if any(c.get("text") or c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    content_chunks += 1
                if content_chunks >= 2:
                    result.abandoned_choices += spec.num_choices
                    result.leaves["mid_stream"] += 1
                    return
    if spec.leave == "mid_stream":
        result.fail(f"a mid_stream leaver saw its whole stream ({len(events)} events): it could not leave")
        return
    _check_stream(spec, events, result)


# -- well-formedness -----------------------------------------------------------------------------------
def _check_full(spec: Spec, data: dict, result: SoakResult) -> None:
    choices, usage = data.get("choices"), data.get("usage") or {}
    if not isinstance(choices, list) or sorted(c.get("index") for c in choices) != list(range(spec.num_choices)):
        result.fail(f"bad choices for n={spec.num_choices}: {str(data)[:200]}")
        return
    for choice in choices:
        text = choice.get("message", {}).get("content") if "message" in choice else choice.get("text")
        if not isinstance(text, str) or choice.get("finish_reason") not in ("stop", "length"):
            result.fail(f"bad choice: {str(choice)[:200]}")
            return
        result.finish_reasons[choice["finish_reason"]] += 1
    _add_usage(spec, usage, result)


def _check_stream(spec: Spec, events: list[str], result: SoakResult) -> None:
    if not events or events[-1] != "[DONE]":
        result.fail(f"stream without [DONE]: {events[-2:]}")
        return
    reasons: dict[int, str] = {}
    usage = None
    for event in events[:-1]:
        chunk = json.loads(event)
        if "error" in chunk:
            result.fail(f"stream error chunk: {event[:200]}")
            return
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            if choice.get("finish_reason") is not None:
                if choice["index"] in reasons:
                    result.fail(f"choice {choice['index']} finished twice")
                reasons[choice["index"]] = choice["finish_reason"]
    if sorted(reasons) != list(range(spec.num_choices)) or set(reasons.values()) - {"stop", "length"}:
        result.fail(f"stream finish reasons {reasons} for {spec.num_choices} choices")
        return
    if usage is None:
        result.fail("stream without its usage chunk")
        return
    result.finish_reasons.update(reasons.values())
    _add_usage(spec, usage, result)


def _add_usage(spec: Spec, usage: dict, result: SoakResult) -> None:
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int) or usage.get("total_tokens") != prompt + completion:
        result.fail(f"bad usage {usage}")
        return
    result.prompt_tokens += prompt * spec.body.get("n", 1)  # usage counts a prompt once, the engine per choice
    result.completion_tokens += completion


# -- the run -------------------------------------------------------------------------------------------
async def run_soak(url: str, specs: list[Spec], concurrency: int, timeout_s: float = 120.0) -> SoakResult:
    result = SoakResult()
    queue: asyncio.Queue[Spec] = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                await run_one(client, queue.get_nowait(), result)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.duration_s = time.monotonic() - start
    return result


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (labels kept verbatim)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def metric_delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def wait_idle(url: str, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = httpx.get(f"{url}/health", timeout=10).json().get("batch", {})
        if batch.get("active_sequences") == 0 and batch.get("queued_requests") == 0:
            return True
        time.sleep(0.1)
    return False


def check_counts(before: dict[str, float], after: dict[str, float], result: SoakResult) -> dict[str, float]:
    """The /metrics deltas of the run against the sums over responses; returns what was compared."""
    def delta(name: str) -> float:
        return metric_delta(after, before, name)

    fr = 'conveyor_requests_finished_total{finish_reason="%s"}'
    pt = 'conveyor_request_prompt_tokens_total{finish_reason="%s"}'
    gt = 'conveyor_request_generation_tokens_total{finish_reason="%s"}'
    compared = {
        "finished stop": (delta(fr % "stop"), result.finish_reasons["stop"]),
        "finished length": (delta(fr % "length"), result.finish_reasons["length"]),
        "finished abort": (delta(fr % "abort"), result.abandoned_choices),
        "finished error": (delta(fr % "error"), 0),
        "prompt tokens (stop+length)": (delta(pt % "stop") + delta(pt % "length"), result.prompt_tokens),
        "generation tokens (stop+length)": (delta(gt % "stop") + delta(gt % "length"), result.completion_tokens),
        "generation tokens total == per-reason sum": (
            delta("conveyor_generation_tokens_total"),
            sum(delta(gt % r) for r in ("stop", "length", "abort", "error"))),
        "rejected": (sum(v - before.get(k, 0.0) for k, v in after.items()
                         if k.startswith("conveyor_requests_rejected_total")), 0),
    }
    for what, (metric, expected) in compared.items():
        if metric != expected:
            result.fail(f"/metrics {what}: {metric:g}, responses say {expected:g}")
    return {k: v[0] for k, v in compared.items()}


def _rss_mib(pid: int | None) -> float | None:
    """The server's resident memory, when it runs on this machine and its pid is known."""
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def soak(url: str, num_requests: int, concurrency: int, seed: int = 0, warmup: int = 48,
         server_pid: int | None = None) -> tuple[SoakResult, dict]:
    """Soak the server at `url` (started with --metrics and a queue deeper than `concurrency`): a warm-up,
    the run, then every check that HTTP can make (no KV block live, /health 200, /metrics == responses).
    The caller owns the server, so it can check more (the pool's integrity in tests/server/test_soak.py)."""
    asyncio.run(run_soak(url, make_specs(warmup, seed + 1), concurrency))  # allocator and caches settle
    wait_idle(url)
    rss_start = _rss_mib(server_pid)
    before = parse_metrics(httpx.get(f"{url}/metrics").text)
    result = asyncio.run(run_soak(url, make_specs(num_requests, seed), concurrency))
    if not wait_idle(url):
        result.fail("engine not idle 60 s after the last response: a request is stuck")
    after = parse_metrics(httpx.get(f"{url}/metrics").text)
    counts = check_counts(before, after, result)
    live = httpx.get(f"{url}/v1/cache/stats").json()["live"]
    if live:
        result.fail(f"{live} KV blocks still live after the soak")
    if httpx.get(f"{url}/health").status_code != 200:
        result.fail("/health is not 200 after the soak")
    rss_end = _rss_mib(server_pid)
    report = {"requests": num_requests, "concurrency": concurrency,
              "duration_s": round(result.duration_s, 1), "statuses": dict(result.statuses),
              "finish_reasons": dict(result.finish_reasons), "abandoned_choices": result.abandoned_choices,
              "leaves": dict(result.leaves), "prompt_tokens": result.prompt_tokens,
              "completion_tokens": result.completion_tokens, "metrics": counts, "live_blocks": live,
              "failures": result.failures[:20]}
    if rss_start is not None and rss_end is not None:
        report.update(rss_start_mib=round(rss_start, 1), rss_end_mib=round(rss_end, 1),
                      rss_growth_mib=round(rss_end - rss_start, 1))
    return result, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="the server to soak (started with --metrics)")
    parser.add_argument("--requests", type=int, default=1200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=48)
    parser.add_argument("--pid", type=int, default=None, help="the server's pid on this machine: report its RSS")
    args = parser.parse_args(argv)
    result, report = soak(args.url.rstrip("/"), args.requests, args.concurrency, args.seed, args.warmup, args.pid)
    print(json.dumps(report, indent=2))
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
