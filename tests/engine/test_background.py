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
