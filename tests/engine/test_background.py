"""engine/background.py: a background load's thread at idle priority, and back, only where it can go back."""

import os

import pytest

from conveyor.engine import background


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_idle_priority_is_undone_after_the_block_or_not_taken_at_all():
    before = os.sched_getscheduler(0)
    with background.idle_priority() as idle:
        inside = os.sched_getscheduler(0)
    assert os.sched_getscheduler(0) == before
    if background.idle_priority_available():  # root or CAP_SYS_NICE (CI runs as root)
        assert idle and inside == os.SCHED_IDLE
    else:
        assert not idle and inside == before


def test_without_a_way_back_the_thread_keeps_its_priority(monkeypatch):
    monkeypatch.setattr(background, "idle_priority_available", lambda: False)
    before = os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None
    with background.idle_priority() as idle:
        assert not idle
        if before is not None:
            assert os.sched_getscheduler(0) == before


class _Clock:
    """time.monotonic and time.sleep on a clock the test moves (no real waiting)."""

    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_paced_weights_rest_after_each_new_tensor_for_the_work_times_the_rest_share(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(background.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(background.time, "sleep", clock.sleep)
    weights = background.PacedWeights({"a": 1, "b": 2, "c": 3}, duty=0.25)  # rest 3x the work
    assert weights["a"] == 1 and clock.slept == []  # the first take: nothing to rest after yet
    clock.now += 0.1  # packing "a"
    assert weights["b"] == 2 and clock.slept == [pytest.approx(0.3)]
    assert weights["b"] == 2 and len(clock.slept) == 1  # a second read of one tensor is not new work
    clock.now += 0.2
    assert weights["c"] == 3 and clock.slept[-1] == pytest.approx(0.6)
    assert len(weights) == 3 and "c" in weights and list(weights) == ["a", "b", "c"]


def test_a_model_loaded_beside_streaming_ones_rests_at_the_configured_duty(monkeypatch):
    """--models-load-duty reaches the engine of a quiet load (and only of a quiet one)."""
    from conveyor.config import ModelsConfig
    from conveyor.server.multimodel import serve

    seen = []

    class FakeEngine:
        @classmethod
        def from_config(cls, config, progress=None, load_threads=0, load_duty=1.0, **kwargs):
            seen.append((load_threads, load_duty))
            raise RuntimeError("stop here")

    monkeypatch.setattr("conveyor.engine.async_engine.AsyncEngine", FakeEngine)
    load = serve.engine_app_loader(None, None, ModelsConfig(models_load_duty=0.4).models_load_duty)
    for quiet in (True, False):
        with pytest.raises(RuntimeError):
            load(type("Spec", (), {"engine_config": None, "server_config": None})(), None, quiet)
    assert seen == [(1, 0.4), (0, 1.0)]
