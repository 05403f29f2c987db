import pytest

from conveyor.testing import tiny_checkpoint as _tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """A 2-layer random Llama with the real SmolLM2 tokenizer, shared by the whole session."""
    return _tiny_checkpoint()
