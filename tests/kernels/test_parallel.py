"""The kernels' work sharing (kernels/csrc/parallel.h): chunks claimed by whichever thread runs.

Which thread runs a chunk must never change a bit: the same results at 1 thread, 2, and more
threads than cores (helpers parked most of the time), from concurrent callers, and in a forked
child (whose pool has no helpers until it makes its own). Every kernel module of a process runs on
one pool (build.share_pool), so concurrent callers of different modules meet in it too. Speed under load is measured in
benchmarks/kernel_contention.py, never asserted here.
"""

import os
import signal
import threading

import pytest
import torch

from conveyor.testing import random_raw
from tests.kernels.conftest import kernel_backend
from tests.kernels.test_attention import _random_batch

backend = kernel_backend("gemm", "qgemm")
Q8_0 = 8
M_VALUES = (1, 5, 16, 33, 80)


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _gemm_case():
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(960, 576, generator=gen) * 0.05).bfloat16()
    packed = backend.pack_linear(weight)
    x = torch.randn(max(M_VALUES), 576, generator=gen).bfloat16()
    return lambda m: backend.linear(x[:m], packed, 960, None)


def _qgemm_case():
    packed = backend.pack_quantized(random_raw(Q8_0, 1000, 576, seed=1), Q8_0, 576)
    x = torch.randn(max(M_VALUES), 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    return lambda m: backend.quantized_linear(x[:m], packed, Q8_0, 1000, 576, None)


@pytest.mark.parametrize("case", [_gemm_case, _qgemm_case], ids=["gemm", "qgemm"])
def test_bits_do_not_depend_on_the_thread_count(case, restore_threads):
    call = case()
    torch.set_num_threads(1)
    want = {m: call(m) for m in M_VALUES}
    for threads in (2, 3, 8):  # 8 on a 2-core box: most helpers are parked at any moment
        torch.set_num_threads(threads)
        for m in M_VALUES:
            assert torch.equal(call(m), want[m]), (threads, m)


def test_concurrent_callers_get_their_own_results(restore_threads):
    # The kernels release the GIL: two engines in one process call into one pool at once.
    torch.set_num_threads(2)
    gemm, qgemm = _gemm_case(), _qgemm_case()
    want = {(name, m): fn(m) for name, fn in (("g", gemm), ("q", qgemm)) for m in M_VALUES}
    mismatches: list[tuple[str, int]] = []

    def hammer(name, fn):
        for _ in range(20):
            for m in M_VALUES:
                if not torch.equal(fn(m), want[name, m]):
                    mismatches.append((name, m))

    threads = [threading.Thread(target=hammer, args=args) for args in (("g", gemm), ("g", gemm), ("q", qgemm))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not mismatches


def test_every_kernel_module_runs_on_one_pool():
    # One set of helpers for a step's kernels (build.share_pool): a pool per module left each module's
    # helper asleep by the time the step came back to it, with the others' helpers still spinning.
    full = kernel_backend("gemm", "qgemm", "attention", "fused_ops", "recurrent")
    modules = [full.gemm, full.qgemm, full.attention, full.fused, full.recurrent]
    assert len({m.pool_abi() for m in modules}) == 1
    assert len({m.pool_handle() for m in modules}) == 1


def test_attention_bits_do_not_depend_on_the_thread_count(restore_threads):
    attention = kernel_backend("attention")
    query, key_cache, value_cache, meta = _random_batch([20, 50, 7], [20, 1, 7], torch.bfloat16, seed=5)
    torch.set_num_threads(1)
    want = attention.paged_attention(query, key_cache, value_cache, meta, scale=0.125)
    for threads in (2, 8):
        torch.set_num_threads(threads)
        assert torch.equal(attention.paged_attention(query, key_cache, value_cache, meta, scale=0.125), want), threads


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_computes_without_the_parents_helpers(restore_threads):
    torch.set_num_threads(2)
    call = _gemm_case()
    want = _bits(call(33))  # the parent's pool has its helper running
    pid = os.fork()
    if pid == 0:  # child: the helper threads did not come along; its pool starts its own
        signal.alarm(60)  # a hang ends the child (SIGALRM), which fails the test instead of stalling it
        try:
            os._exit(0 if _bits(call(33)) == want else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _bits(t: torch.Tensor) -> bytes:
    # NOTE: through numpy: a forked child must not run torch's own OpenMP ops (libgomp hangs after fork).
    return t.view(torch.int16).numpy().tobytes()
