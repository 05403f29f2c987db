"""Adaptive draft policy (a draft model or an MTP head): is a verify round worth it at this load level, on this
machine?

A draft round costs k draft forwards plus a wider target forward; it pays only when enough drafts
are accepted, and whether it does depends on the pairing, the hardware and the batch size (at
high batch the target step is compute-bound and the drafts stop being free). So the policy
measures instead of guessing: for each batch-size bucket it runs PROFILE_TICKS decode ticks
with drafts and PROBE_TICKS classic ticks without, compares tokens per second, and settles to
enable or decline. Verdicts persist as JSON under <cache dir>/spec-policy/, keyed by target,
draft, block size, backend and CPU, so a restart skips profiling (the seeds' mtp-policy).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, field

logger = logging.getLogger(__name__)

PROFILE_TICKS = 8  # speculative decode ticks measured per bucket
PROBE_TICKS = 8  # classic decode ticks measured per bucket
MIN_SPEEDUP = 1.05  # enable only when drafts beat classic steps by this much
VERSION = 1


@dataclass
class BucketMeasure:
    spec_ticks: int = 0
    spec_tokens: int = 0
    spec_seconds: float = 0.0
    classic_ticks: int = 0
    classic_tokens: int = 0
    classic_seconds: float = 0.0

    def rates(self) -> tuple[float, float]:
        return (self.spec_tokens / max(self.spec_seconds, 1e-9), self.classic_tokens / max(self.classic_seconds, 1e-9))


@dataclass
class Verdict:
    verdict: str  # "enable" | "decline"
    est_speedup: float
    spec_tokens_per_s: float
    classic_tokens_per_s: float
    settled_at: float = field(default_factory=time.time)


def bucket_of(batch_size: int) -> int:
    """Load levels: 1, 2, 4, 8, 16, ... (a power of two at or above the batch size)."""
    bucket = 1
    while bucket < batch_size:
        bucket *= 2
    return bucket


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "conveyor")


def machine_id() -> str:
    """The CPU model as /proc/cpuinfo names it (else the platform), plus the core count."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name} x{os.cpu_count()}"


class SpecPolicy:
    def __init__(self, mode: str, key: dict[str, str], cache_dir: str | None = None) -> None:
        self.mode = mode  # adaptive | enable | decline
        self.key = key
        self.measures: dict[int, BucketMeasure] = {}
        self.verdicts: dict[int, Verdict] = {}
        digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.path = os.path.join(cache_dir or default_cache_dir(), "spec-policy", f"{digest}.json")
        if mode == "adaptive":
            self._load()

    # -- the decision ----------------------------------------------------------------------
    def allows(self, batch_size: int) -> bool:
        if self.mode != "adaptive":
            return self.mode == "enable"
        bucket = bucket_of(batch_size)
        verdict = self.verdicts.get(bucket)
        if verdict is not None:
            return verdict.verdict == "enable"
        measure = self.measures.setdefault(bucket, BucketMeasure())
        return measure.spec_ticks < PROFILE_TICKS  # profile with drafts first, then probe classic steps

    def observe(self, batch_size: int, speculative: bool, num_tokens: int, seconds: float) -> None:
        """One pure decode tick: did drafts run, how many tokens it produced, how long it took."""
        if self.mode != "adaptive" or batch_size < 1:
            return
        bucket = bucket_of(batch_size)
        if bucket in self.verdicts:
            return
        m = self.measures.setdefault(bucket, BucketMeasure())
        if speculative:
            m.spec_ticks, m.spec_tokens, m.spec_seconds = m.spec_ticks + 1, m.spec_tokens + num_tokens, m.spec_seconds + seconds
        else:
            m.classic_ticks += 1
            m.classic_tokens += num_tokens
            m.classic_seconds += seconds
        if m.spec_ticks >= PROFILE_TICKS and m.classic_ticks >= PROBE_TICKS:
            self._settle(bucket, m)

    def _settle(self, bucket: int, measure: BucketMeasure) -> None:
        spec_rate, classic_rate = measure.rates()
        speedup = spec_rate / max(classic_rate, 1e-9)
        verdict = Verdict("enable" if speedup >= MIN_SPEEDUP else "decline", round(speedup, 3),
                          round(spec_rate, 1), round(classic_rate, 1))
        self.verdicts[bucket] = verdict
        logger.info("adaptive draft policy: settled verdict %s at batch <= %d est_speedup=%.2f [measured]",
                    verdict.verdict, bucket, speedup)
        self._save()

    # -- persistence and the report --------------------------------------------------------
    def report(self) -> dict:
        return {
            "version": VERSION, "mode": self.mode, "key": self.key, "path": self.path,
            "verdicts": {str(b): asdict(v) for b, v in sorted(self.verdicts.items())},
            "profiling": {str(b): asdict(m) for b, m in sorted(self.measures.items()) if b not in self.verdicts},
        }

    def _load(self) -> None:
        try:
            with open(self.path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return
        if data.get("version") != VERSION or data.get("key") != self.key:
            return
        try:
            self.verdicts = {int(b): Verdict(**v) for b, v in data.get("verdicts", {}).items()}
        except (TypeError, ValueError):
            self.verdicts = {}
            return
        logger.info("adaptive draft policy: loaded %d verdict(s) from %s", len(self.verdicts), self.path)

    def _save(self) -> None:
        data = {"version": VERSION, "key": self.key,
                "verdicts": {str(b): asdict(v) for b, v in sorted(self.verdicts.items())}}
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, self.path)  # atomic: a concurrent reader sees the old file or the new one
        except OSError as exc:  # a read-only home must not stop serving
            logger.warning("adaptive draft policy: cannot persist verdicts to %s: %s", self.path, exc)
