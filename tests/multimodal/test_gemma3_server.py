"""The server with a vision model: /props says it sees (modalities.vision), a text model says it does not;
/metrics counts the tower's work."""

import httpx
import pytest
from tiny_gemma3_vision import random_image, write_model_dir
from vision_harness import data_url, image_part, post_chat, with_template

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


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_metrics_count_the_towers_work(gemma3):
    with serve(gemma3, EngineConfig(parallel=2)) as served:
        before = httpx.get(f"{served.url}/metrics").text
        assert _metric(before, "conveyor_vision_images_encoded_total") == 0
        for _ in range(2):  # the same image twice: one encode
            post_chat(served, [image_part(data_url(random_image(0))), {"type": "text", "text": "What?"}], max_tokens=2)
        after = httpx.get(f"{served.url}/metrics").text
        assert _metric(after, "conveyor_vision_images_encoded_total") == 1
        assert _metric(after, "conveyor_vision_encode_seconds_total") > 0
        assert _metric(after, "conveyor_vision_encoder_cache_images") == 1


TEXT_ONLY_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] | trim }}"
                      "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def _chat(served, image_seed: int) -> dict:
    parts = [image_part(data_url(random_image(image_seed))), {"type": "text", "text": "What?"}]
    return post_chat(served, parts, max_tokens=6, temperature=0, logprobs=True)


def test_a_text_only_template_gets_the_marker_as_text(gemma3):
    """A vision model whose template renders no image parts (gemma-3-270m's, copied beside an mmproj): the parts
    are written as the marker text, as llama-server writes its media marker; same answer as the image template's."""
    with serve(gemma3, EngineConfig(parallel=2)) as served:
        want = [_chat(served, seed) for seed in (0, 1)]
    text_only = with_template(gemma3, TEXT_ONLY_TEMPLATE)
    with serve(text_only, EngineConfig(parallel=2)) as served:
        got = [_chat(served, seed) for seed in (0, 1)]
    for g, w in zip(got, want):
        assert g["choices"][0]["message"]["content"] == w["choices"][0]["message"]["content"]
        assert g["usage"]["prompt_tokens"] == w["usage"]["prompt_tokens"]
        assert g["choices"][0]["logprobs"] == w["choices"][0]["logprobs"]  # bitwise: the same prompt, not just words


def test_models_dir_pairs_a_subfolders_mmproj(tmp_path):
    from conveyor.config import ModelsConfig, ServerConfig
    from conveyor.server.multimodel.catalog import build_catalog

    for path in (tmp_path / "gemma" / "gemma-3-4b-Q4_K_M.gguf", tmp_path / "gemma" / "mmproj-F16.gguf",
                 tmp_path / "text-only.gguf", tmp_path / "mmproj-stray.gguf"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    specs = {s.name: s for s in build_catalog(ModelsConfig(models_dir=str(tmp_path)), EngineConfig(),
                                              ServerConfig(port=9000))}
    assert specs["gemma"].engine_config.mmproj == str(tmp_path / "gemma" / "mmproj-F16.gguf")
    assert specs["text-only"].engine_config.mmproj is None
