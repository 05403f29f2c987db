"""The server with a vision model: /props says it sees (modalities.vision), a text model says it does not."""

import httpx
import pytest
from tiny_gemma3_vision import write_model_dir

from conveyor.config import EngineConfig
from conveyor.loading.hf_loader import load_hf_dir
from tests.server.conftest import serve

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_server")
    write_model_dir(path, transformers)
    return load_hf_dir(str(path))


def test_props_modalities(gemma3, tiny_checkpoint):
    with serve(gemma3, EngineConfig(parallel=2)) as served:
        assert httpx.get(f"{served.url}/props").json()["modalities"] == {"vision": True, "audio": False}
    with serve(tiny_checkpoint, EngineConfig(parallel=2)) as served:
        assert httpx.get(f"{served.url}/props").json()["modalities"] == {"vision": False, "audio": False}
