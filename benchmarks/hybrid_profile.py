"""Where one decode step of a hybrid model goes (issue #24): C concurrent requests through the offline engine,
the step timed with nested wall-clock timers around every linear (per weight), every kernel call of the backend,
each mixer, each layer and the runner's phases. A timer's *self* time excludes the timers inside it, so the
mixers' and layers' self time is the Python/torch glue between kernels.

Usage:
  PYTHONPATH=$PWD python benchmarks/hybrid_profile.py FILE.gguf [--concurrency 16] [--steps 24] [--threads 0]
      [--kernel-arch native] [--prefill --prompt-tokens 1480 [--warm]] [--prompt-tokens 4096 --shared-prefix 4000]

Prints one markdown table: per label, calls per step and the median / mean ms per step over the timed steps.
Timers cost ~1 us per call (a few hundred per step). On a shared machine wall times swing with the load;
--cpu-time runs one thread and reads its CPU time, the figure to compare in A/B runs.
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from conveyor.engine.llm import LLM  # noqa: E402
from conveyor.engine.sampling_params import SamplingParams  # noqa: E402
from conveyor.kernels.backend import KernelBackend  # noqa: E402
from conveyor.models.layers import RowInvariantLinear  # noqa: E402

BACKEND_OPS = ("short_conv", "gated_delta_rule", "gated_rms_norm", "sigmoid_mul", "paged_attention", "rms_norm",
               "add_rms_norm", "silu_mul", "gelu_tanh_mul", "rope_write_kv", "write_kv", "argmax", "sigmoid", "silu_gate")


class Timers:
    """Nested timers: each label's total and self (total minus the timers inside it) per step."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.stack: list[list] = []  # [label, start, child time]
        self.self_ms: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False

    def wrap(self, label: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            self.stack.append([label, self.clock(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                name, start, child = self.stack.pop()
                elapsed = self.clock() - start
                self.self_ms[name] += (elapsed - child) * 1e3
                self.calls[name] += 1
                if self.stack:
                    self.stack[-1][2] += elapsed
        return timed

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        out = dict(self.self_ms), dict(self.calls)
        self.self_ms.clear()
        self.calls.clear()
        return out


def _kind(module_name: str) -> str:
    """layers.7.mixers.0.in_proj -> the layer's kind + the weight: a label shared by every layer of that kind."""
    return re.sub(r"layers\.\d+\.", "", module_name)


def instrument(llm: LLM, timers: Timers) -> None:
    engine = llm.engine
    runner = engine.runner
    model = runner.model
    kinds = {i: ("deltanet" if "linear" in t else "attention") for i, t in enumerate(model.config.layer_types)}
    for name, module in model.named_modules():
        match = re.fullmatch(r"layers\.(\d+)(?:\.(.*))?", name)
        prefix = f"{kinds.get(int(match.group(1)), 'attention')}." if match else ""
        if isinstance(module, RowInvariantLinear):
            module.forward = timers.wrap(f"gemm {prefix}{_kind(name)}", module.forward)
            if hasattr(module, "forward_split"):  # (absent before it was added: A/B runs against older code)
                module.forward_split = timers.wrap(f"gemm {prefix}{_kind(name)}", module.forward_split)
        elif match and re.fullmatch(r"mixers\.\d+", match.group(2) or ""):
            module.forward = timers.wrap(f"glue {prefix}{type(module).__name__}", module.forward)
        elif match and match.group(2) is None:
            module.forward = timers.wrap(f"glue {prefix}layer (residual, norms' calls)", module.forward)
    model.forward = timers.wrap("glue model (embedding, final norm, logits)", model.forward)
    for op in BACKEND_OPS:
        setattr(KernelBackend, op, timers.wrap(f"kernel {op}", getattr(KernelBackend, op)))
    if hasattr(KernelBackend, "quantized_linear_grouped"):  # MoE experts in one call per projection (absent before)
        KernelBackend.quantized_linear_grouped = timers.wrap("gemm experts, grouped",
                                                             KernelBackend.quantized_linear_grouped)
    runner.execute = timers.wrap("runner (sampling, outputs)", runner.execute)
    runner.prepare_inputs = timers.wrap("runner prepare_inputs", runner.prepare_inputs)
    engine.step = timers.wrap("engine (schedule, update, detokenize)", engine.step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=24, help="decode steps timed")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--kernel-arch", default="native", help="-march of conveyor's kernels (x86-64-v3: the AVX2 level; "
                   "LLM() takes it from here, not from CONVEYOR_KERNEL_ARCH)")
    p.add_argument("--prefill", action="store_true", help="time the prefill of one --prompt-tokens prompt instead "
                   "(all its chunks, summed) of the decode steps")
    p.add_argument("--shared-prefix", type=int, default=0, help="the first N of every prompt's tokens the same (fan-out "
                   "requests on one prompt): the first request is prefilled alone, so the others find its blocks in the "
                   "prefix cache")
    p.add_argument("--warm", action="store_true", help="with --prefill: prefill another prompt of the same length "
                   "first, untimed (a server's first request pays first touches of its buffers and state; the later "
                   "ones, what TTFT benchmarks time after their warm-up, do not)")
    p.add_argument("--cpu-time", action="store_true", help="one thread, timed in its CPU time: what a busy "
                   "machine's scheduling does not inflate (the work itself, for A/B runs)")
    args = p.parse_args()
    threads = 1 if args.cpu_time else args.threads
    if args.prefill:
        args.concurrency = 1
    llm = LLM(model=args.file, parallel=args.concurrency, speculative_ngram=0, threads=threads, kernel_arch=args.kernel_arch,
              ctx_size=args.concurrency * max(512, args.prompt_tokens + args.steps + 16))
    timers = Timers(time.thread_time if args.cpu_time else time.perf_counter)
    instrument(llm, timers)
    engine = llm.engine
    vocab = llm.tokenizer.vocab_size
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    if args.prefill and args.warm:
        warm_ids = [(104729 * j + 17) % (vocab - 100) + 50 for j in range(args.prompt_tokens)]
        warm = engine.make_request(warm_ids, SamplingParams(max_tokens=1, temperature=0.0))
        engine.add_request(warm)
        while engine.has_work():  # (the timers are off until report_prefill)
            engine.step()
    for i in range(args.concurrency):
        ids = [(7919 * ((i if j >= args.shared_prefix else 0) * args.prompt_tokens + j)) % (vocab - 100) + 50
               for j in range(args.prompt_tokens)]
        request = engine.make_request(ids, params)
        engine.add_request(request)
        while i == 0 and args.shared_prefix and not request.output_token_ids:
            engine.step()  # its prompt's blocks cached before the others arrive
    if args.prefill:
        report_prefill(args, engine, timers)
        return
    # Prefill and the first decode steps untimed (the last prefill may share a tick with decode rows).
    while any(len(r.output_token_ids) < 3 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    steps: list[dict[str, float]] = []
    calls: dict[str, int] = {}
    timers.on = True
    for _ in range(args.steps):
        engine.step()
        step, calls = timers.take()
        steps.append(step)
    timers.on = False
    labels = sorted({k for s in steps for k in s}, key=lambda k: -statistics.median(s.get(k, 0.0) for s in steps))
    totals = [sum(s.values()) for s in steps]
    clock = "thread CPU time" if args.cpu_time else "wall time"
    print(f"{args.file}: C={args.concurrency}, {args.steps} decode steps, -march={args.kernel_arch}, threads "
          f"{torch.get_num_threads()}, {clock}; "
          f"step median {statistics.median(totals):.1f} ms, min {min(totals):.1f} ms")
    print("| part | calls / step | median ms / step | share |")
    print("|---|---|---|---|")
    median_total = statistics.median(totals)
    for label in labels:
        med = statistics.median(s.get(label, 0.0) for s in steps)
        print(f"| {label} | {calls.get(label, 0)} | {med:.2f} | {med / median_total:.1%} |")


def report_prefill(args: argparse.Namespace, engine, timers: Timers) -> None:
    """The prompt's prefill chunks timed as one total (each part summed over the chunks)."""
    timers.on = True
    total: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    chunks = 0
    while not any(r.output_token_ids for r in engine.scheduler.running):
        engine.step()
        step, step_calls = timers.take()
        chunks += 1
        for label, ms in step.items():
            total[label] += ms
            calls[label] += step_calls.get(label, 0)
    timers.on = False
    whole = sum(total.values())
    clock = "thread CPU time" if args.cpu_time else "wall time"
    print(f"{args.file}: prefill of {args.prompt_tokens} tokens in {chunks} steps, -march={args.kernel_arch}, threads "
          f"{torch.get_num_threads()}, "
          f"{clock}; {whole / 1e3:.2f} s ({args.prompt_tokens / whole * 1e3:.0f} tok/s)")
    print("| part | calls | ms | share |")
    print("|---|---|---|---|")
    for label in sorted(total, key=lambda k: -total[k]):
        print(f"| {label} | {calls[label]} | {total[label]:.1f} | {total[label] / whole:.1%} |")


if __name__ == "__main__":
    main()
