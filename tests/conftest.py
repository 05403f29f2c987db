import os

import pytest

# The device every engine in the suite runs on: `CONVEYOR_TEST_DEVICE=cuda make test` runs the
# suite unchanged on a GPU (engines read CONVEYOR_DEVICE). Bitwise batch invariance is a guarantee
# of our CPU kernels only, so tests marked batch_invariant are skipped, with the reason, elsewhere.
TEST_DEVICE = os.environ.get("CONVEYOR_TEST_DEVICE", "cpu")
os.environ["CONVEYOR_DEVICE"] = TEST_DEVICE

from conveyor.testing import tiny_checkpoint as _tiny_checkpoint  # noqa: E402


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
