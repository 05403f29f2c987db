import os
import time
import weakref

import pytest

# The device every engine in the suite runs on: `CONVEYOR_TEST_DEVICE=cuda make test` runs the
# suite unchanged on a GPU (engines read CONVEYOR_DEVICE). Bitwise batch invariance is a guarantee
# of our CPU kernels only, so tests marked batch_invariant are skipped, with the reason, elsewhere.
TEST_DEVICE = os.environ.get("CONVEYOR_TEST_DEVICE", "cpu")
os.environ["CONVEYOR_DEVICE"] = TEST_DEVICE

from conveyor.engine.block_pool import BlockPool  # noqa: E402
from conveyor.testing import tiny_checkpoint as _tiny_checkpoint  # noqa: E402

# Every KV block pool any test builds (engines, servers, bare schedulers), for the check below.
_POOLS: "weakref.WeakSet[BlockPool]" = weakref.WeakSet()
_block_pool_init = BlockPool.__init__


def _tracked_init(self, *args, **kwargs):
    _block_pool_init(self, *args, **kwargs)
    _POOLS.add(self)


BlockPool.__init__ = _tracked_init
INTEGRITY_RETRY_S = 60.0  # a server's engine thread may still be finishing an abort (only a leak waits it out)


@pytest.fixture(autouse=True)
def _kv_pools_intact():
    """check_integrity() of every live KV pool after every test (README: "nothing leaks")."""
    yield
    for pool in list(_POOLS):
        deadline = time.monotonic() + INTEGRITY_RETRY_S
        while True:
            try:
                pool.check_integrity()
                break
            except (AssertionError, RuntimeError):  # RuntimeError: mutated by an engine thread mid-check
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)


def pytest_configure(config):
    config.addinivalue_line("markers", "batch_invariant: asserts bitwise batch invariance (CPU kernels only)")


def pytest_collection_modifyitems(config, items):
    if TEST_DEVICE == "cpu":
        return
    skip = pytest.mark.skip(reason=f"bitwise batch invariance is not claimed on {TEST_DEVICE}")
    for item in items:
        if "batch_invariant" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """A 2-layer random Llama with the real SmolLM2 tokenizer, shared by the whole session."""
    return _tiny_checkpoint()
