"""Adaptive draft policy (a draft model or an MTP head): is a verify round worth it at this load level, on this
machine?

A draft round costs k draft forwards plus a wider target forward; it pays only when enough drafts
are accepted, and whether it does depends on the pairing, the hardware and the batch size (at
high batch the target step is compute-bound and the drafts stop being free). How many to draft
depends on the same things: a longer draft pays only while its later tokens are still accepted
often enough to cover their forwards. So the policy measures instead of guessing: for each
batch-size bucket it first runs PROBE_TICKS classic ticks without drafts, then PROFILE_TICKS decode
ticks at the candidate draft lengths (the block size K and the powers of two below it), shortest
first, compares tokens per second, and settles on the fastest length, or declines when no length
beats classic steps by MIN_SPEEDUP. Profiling a losing length is what a cold policy costs, so:
- a length is tried only while the one below it beat everything shorter (classic steps included).
  Going from k to the next length adds drafts that are accepted less often (a^(k+1) < a^k) for
  forwards and verify rows that cost at least as much as the last ones (the verify forward's cost
  grows at least linearly in rows once it is compute-bound), so when a length did not raise the
  rate, no longer one will: at a batch where drafts lose, only the cheapest length (1) is profiled;
- a length whose first EARLY_TICKS run below EARLY_CUT of the best rate so far is not profiled
  further (and a tick the policy will not measure, one with prompt rows in it, drafts nothing
  while its bucket profiles);
- a bucket above a declined one declines without profiling (drafts only pay less as the batch
  grows: the verify forward turns compute-bound while acceptance per row stays the same).

Verdicts persist as JSON under <cache dir>/spec-policy/, keyed by target, draft, block size, backend
and CPU, so a restart skips profiling (the seeds' mtp-policy).
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
EARLY_TICKS = 2  # ticks after which a clearly losing length stops being profiled
EARLY_CUT = 0.95  # "losing": below this share of the classic rate (then MIN_SPEEDUP is out of reach)
VERSION = 2  # 2: a verdict carries its draft length


@dataclass
class RateMeasure:
    ticks: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def add(self, num_tokens: int, seconds: float) -> None:
        self.ticks, self.tokens, self.seconds = self.ticks + 1, self.tokens + num_tokens, self.seconds + seconds

    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


@dataclass
class BucketMeasure:
    spec: dict[int, RateMeasure] = field(default_factory=dict)  # by draft length
    classic: RateMeasure = field(default_factory=RateMeasure)


@dataclass
class Verdict:
    verdict: str  # "enable" | "decline"
    est_speedup: float  # the chosen length's (the best length's when declined) over classic steps
    spec_tokens_per_s: float
    classic_tokens_per_s: float
    length: int = 0  # drafts per row when enabled
    by_length: dict[str, float] = field(default_factory=dict)  # tokens/s measured at each length
    settled_at: float = field(default_factory=time.time)
    inferred_from: int = 0  # the smaller declined bucket this decline follows from (0: measured here)


def draft_lengths(block_size: int) -> list[int]:
    """The lengths profiled, shortest first: the powers of two below K, and K."""
    lengths, k = [block_size], 1
    while k < block_size:
        lengths.append(k)
        k *= 2
    return sorted(set(lengths))


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
    def __init__(self, mode: str, key: dict[str, str], cache_dir: str | None = None, block_size: int = 1) -> None:
        self.mode = mode  # adaptive | enable | decline
        self.key = key
        self.block_size = block_size  # K: the longest draft
        self.lengths = draft_lengths(block_size)
        self.measures: dict[int, BucketMeasure] = {}
        self.verdicts: dict[int, Verdict] = {}
        self._handed: dict[int, int] = {}  # bucket -> the length draft_length gave its latest tick
        digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.path = os.path.join(cache_dir or default_cache_dir(), "spec-policy", f"{digest}.json")
        if mode == "adaptive":
            self._load()

    # -- the decision ----------------------------------------------------------------------
    def draft_length(self, batch_size: int, measured: bool = True) -> int:
        """Drafts per row for a tick at this batch size (0: a classic tick). `measured`: whether observe() will see
        the tick (a pure decode tick); while the bucket is still profiling, a tick it will not see runs classic: its
        drafts would cost without telling the policy anything (a cold C=16 run drafted ~1.8x the profile's tokens in
        the ticks where prompts were still prefilling)."""
        if self.mode != "adaptive":
            return self.block_size if self.mode == "enable" else 0
        bucket = bucket_of(batch_size)
        verdict = self.verdicts.get(bucket) or self._infer_decline(bucket)
        if verdict is not None:
            return verdict.length if verdict.verdict == "enable" else 0
        if not measured:
            return 0
        measure = self.measures.setdefault(bucket, BucketMeasure())
        # Probe classic steps first (the baseline the early cut needs), then lengths, shortest first.
        length = 0
        if measure.classic.ticks >= PROBE_TICKS:
            length = self._next_length(measure) or 0
        self._handed[bucket] = length
        return length

    def _next_length(self, measure: BucketMeasure) -> int | None:
        """The length to profile next, or None when profiling is over: every length is measured, or the last one
        measured did not beat the best rate below it (then no longer length will; the module's docstring)."""
        best = measure.classic.rate()
        for k in self.lengths:
            rate = measure.spec.get(k, RateMeasure())
            if rate.ticks < PROFILE_TICKS and not (rate.ticks >= EARLY_TICKS and rate.rate() < EARLY_CUT * best):
                return k  # still profiling this one
            if rate.rate() <= best:
                return None  # it lost to a shorter length (or to classic steps): stop here
            best = rate.rate()
        return None

    def _infer_decline(self, bucket: int) -> Verdict | None:
        """A decline at a smaller bucket holds here too; recorded (and persisted) as inferred."""
        below = [b for b, v in self.verdicts.items() if b < bucket and v.verdict == "decline"]
        if not below:
            return None
        source = self.verdicts[max(below)]
        verdict = Verdict("decline", source.est_speedup, source.spec_tokens_per_s, source.classic_tokens_per_s,
                          inferred_from=max(below))
        self.verdicts[bucket] = verdict
        self.measures.pop(bucket, None)
        logger.info("adaptive draft policy: decline at batch <= %d follows from the decline at batch <= %d",
                    bucket, max(below))
        self._save()
        return verdict

    def defers_recording(self, batch_size: int) -> bool:
        """Whether an MTP / EAGLE3 head may keep this tick's rows waiting (runner/mtp_runner.py): nothing drafts at
        this batch size yet, because drafting is declined here or because the bucket is still probing classic steps.
        They run through the head only if the request drafts later (that tick is not timed): so the probe's classic
        ticks are timed as a declined bucket runs (without the head's rows, which they used to include), and a request
        that ends before any draft never pays for them."""
        if self.mode != "adaptive":
            return self.mode == "decline"
        bucket = bucket_of(batch_size)
        verdict = self.verdicts.get(bucket) or self._infer_decline(bucket)
        if verdict is not None:
            return verdict.verdict == "decline"
        measure = self.measures.get(bucket)
        return measure is None or measure.classic.ticks < PROBE_TICKS

    def allows(self, batch_size: int) -> bool:
        return self.draft_length(batch_size) > 0

    def observe(self, batch_size: int, speculative: bool, num_tokens: int, seconds: float) -> None:
        """One pure decode tick: did drafts run, how many tokens it produced, how long it took. A drafted tick
        counts for the length draft_length last gave its bucket."""
        if self.mode != "adaptive" or batch_size < 1:
            return
        bucket = bucket_of(batch_size)
        if bucket in self.verdicts:
            return
        m = self.measures.setdefault(bucket, BucketMeasure())
        if speculative:
            length = self._handed.get(bucket) or self.block_size
            m.spec.setdefault(length, RateMeasure()).add(num_tokens, seconds)
        else:
            m.classic.add(num_tokens, seconds)
        if m.classic.ticks >= PROBE_TICKS and self._next_length(m) is None:
            self._settle(bucket, m)

    def _settle(self, bucket: int, measure: BucketMeasure) -> None:
        classic_rate = measure.classic.rate()
        rates = {k: measure.spec[k].rate() for k in self.lengths if k in measure.spec}  # the lengths profiled
        best = max(rates, key=lambda k: (rates[k], -k))  # ties: the shorter draft (fewer forwards)
        speedup = rates[best] / max(classic_rate, 1e-9)
        enable = speedup >= MIN_SPEEDUP
        verdict = Verdict("enable" if enable else "decline", round(speedup, 3), round(rates[best], 1),
                          round(classic_rate, 1), best if enable else 0,
                          {str(k): round(r, 1) for k, r in sorted(rates.items())})
        self.verdicts[bucket] = verdict
        logger.info("adaptive draft policy: settled verdict %s at batch <= %d, draft length %d, est_speedup=%.2f "
                    "[measured]", verdict.verdict, bucket, verdict.length, speedup)
        self._save()

    # -- persistence and the report --------------------------------------------------------
    def report(self) -> dict:
        return {
            "version": VERSION, "mode": self.mode, "key": self.key, "path": self.path,
            "verdicts": {str(b): asdict(v) for b, v in sorted(self.verdicts.items())},
            "block_size": self.block_size, "lengths": self.lengths,
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
