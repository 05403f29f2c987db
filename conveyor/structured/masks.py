"""Per-row token masks for the constrained rows of a batched step, computed beside the forward.

    engine.step:  plan = schedule()
                  job = masker.start(constrained rows)   -> worker thread: llguidance fills bitmasks
                  runner.execute(plan, job)              -> forward (main thread) ...
                      job.apply(logits, row ids)         <- waits (usually not at all), masks rows
                  scheduler.update(...)                  -> matchers consume the sampled tokens

llguidance drops the GIL while it computes, so the masks are ready by the time the logits are.
Free rows are never touched: a constrained row and a free row share one forward and one sampler.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import llguidance.torch as llg_torch
import numpy as np
import torch

from conveyor.structured.compiler import GrammarState


@dataclass
class MaskStats:
    num_masks: int = 0  # row-steps masked
    num_steps: int = 0  # steps with at least one constrained row
    fill_seconds: float = 0.0  # llguidance time (worker thread, overlapped with the forward)
    wait_seconds: float = 0.0  # time the step waited for masks after its forward: the real stall
    apply_seconds: float = 0.0  # unpacking bits and filling -inf into the logits (main thread)


class MaskJob:
    """The masks of one step's constrained rows; `apply` waits for them and masks the logits in place."""

    def __init__(self, future: Future, index: dict[str, int], stats: MaskStats) -> None:
        self._future = future
        self.index = index  # request id -> row of the bitmask
        self._stats = stats

    def apply(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        rows = [i for i, rid in enumerate(request_ids) if rid in self.index]
        start = time.perf_counter()
        disallowed: torch.Tensor = self._future.result()  # (N, V) bool, unpacked on the worker
        waited = time.perf_counter() - start
        if rows:
            which = [self.index[request_ids[i]] for i in rows]
            if rows != list(range(len(request_ids))) or which != list(range(len(which))):
                full = torch.zeros(logits.shape, dtype=torch.bool)  # (R, V): free rows stay all-allowed
                full[rows] = disallowed[which]
                disallowed = full
            with torch.inference_mode():  # the logits are an inference tensor
                logits.masked_fill_(disallowed.to(logits.device), float("-inf"))  # one pass over (R, V)
        stats = self._stats
        stats.wait_seconds += waited
        stats.apply_seconds += time.perf_counter() - start - waited

    def wait(self) -> None:
        self._future.result()


class GrammarMasker:
    def __init__(self, vocab_size: int, logits_width: int, num_threads: int = 0) -> None:
        """num_threads 0: masks are filled one row after another on our one worker thread.
        NOTE: llguidance's parallel executor (a rayon pool) spins between batches; on a small CPU
        that steals cores from the forward's threads and made constrained steps ~2x slower (2 vCPU,
        benchmarks/results.md), for masks that cost ~0.1 ms per row anyway."""
        self.vocab_size = vocab_size  # the grammar tokenizer's (>= logits_width)
        self.logits_width = logits_width
        self.stats = MaskStats()
        self._executor = llguidance.LLExecutor(num_threads=num_threads) if num_threads else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conveyor-masks")

    def start(self, rows: list[tuple[str, GrammarState]]) -> MaskJob | None:
        """Begin computing the masks of `rows` (request id, grammar state); None when there are none."""
        if not rows:
            return None
        index = {rid: i for i, (rid, _) in enumerate(rows)}
        matchers = [(state.matcher, i) for i, (_, state) in enumerate(rows)]
        future = self._worker.submit(self._fill, matchers, self.logits_width)
        self.stats.num_steps += 1
        self.stats.num_masks += len(rows)
        return MaskJob(future, index, self.stats)

    def _fill(self, matchers: list[tuple[llguidance.LLMatcher, int]], width: int) -> torch.Tensor:
        """llguidance's packed bitmasks, unpacked to (N, width) "disallowed" flags (both drop the GIL)."""
        start = time.perf_counter()
        bitmask = torch.full(llg_torch.get_bitmask_shape(len(matchers), self.vocab_size), -1, dtype=torch.int32)
        if self._executor is not None:
            llg_torch.fill_next_token_bitmask_par(self._executor, matchers, bitmask)
        else:
            for matcher, row in matchers:
                llg_torch.fill_next_token_bitmask(matcher, bitmask, row)
        # Bit j of word w allows token 32 w + j: little-endian bytes, least significant bit first.
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :width]
        disallowed = torch.from_numpy(bits == 0)
        self.stats.fill_seconds += time.perf_counter() - start
        return disallowed

    def close(self) -> None:
        self._worker.shutdown(wait=True)
