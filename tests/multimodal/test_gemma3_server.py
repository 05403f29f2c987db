"""The server with a vision model: /props says it sees (modalities.vision), a text model says it does not;
/metrics counts the tower's work."""

import base64
import io

import httpx
import pytest
from tiny_gemma3_vision import random_image, write_model_dir

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


def _data_url(seed: int) -> str:
    buffer = io.BytesIO()
    random_image(seed).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_metrics_count_the_towers_work(gemma3):
    with serve(gemma3, EngineConfig(parallel=2)) as served:
        before = httpx.get(f"{served.url}/metrics").text
        assert _metric(before, "conveyor_vision_images_encoded_total") == 0
        for _ in range(2):  # the same image twice: one encode
            body = {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": _data_url(0)}}, {"type": "text", "text": "What?"}]}],
                "max_tokens": 2}
            assert httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
        after = httpx.get(f"{served.url}/metrics").text
        assert _metric(after, "conveyor_vision_images_encoded_total") == 1
        assert _metric(after, "conveyor_vision_encode_seconds_total") > 0
        assert _metric(after, "conveyor_vision_encoder_cache_images") == 1
