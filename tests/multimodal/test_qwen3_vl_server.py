"""Qwen3-VL over HTTP (DeepStack levels riding the image rows): chat image_url parts reach the model as the
template's <|vision_start|><|image_pad|><|vision_end|>, each pad expanded to the image's rows, with the engine's own
greedy answer; a text-only template gets the whole wrapped marker as text and the same answer; a bad image is a 400."""

import base64
import io
from dataclasses import replace

import httpx
import pytest
from tiny_qwen3_vl import random_image, write_model_dir

from conveyor.config import EngineConfig
from conveyor.engine.engine import EngineCore
from conveyor.engine.sampling_params import SamplingParams
from conveyor.loading.hf_loader import load_hf_dir
from conveyor.multimodal.image_input import ImageInput
from tests.server.conftest import serve

transformers = pytest.importorskip("transformers")

# Qwen's templates write <|vision_start|><|image_pad|><|vision_end|> for an image part
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
TEXT_ONLY = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "<|im_start|>assistant\n")
SIZES = [(50, 40), (33, 70)]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_vl_server")
    write_model_dir(path, transformers)
    checkpoint = load_hf_dir(str(path))
    return replace(checkpoint, tokenizer=replace(checkpoint.tokenizer, chat_template=TEMPLATE))


def _data_url(i: int) -> str:
    buffer = io.BytesIO()
    random_image(*SIZES[i], i).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _chat(served) -> dict:
    parts = [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": _data_url(0)}},
             {"type": "text", "text": "and"}, {"type": "image_url", "image_url": {"url": _data_url(1)}}]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _expected(checkpoint) -> tuple[str, int]:
    core = EngineCore(EngineConfig(parallel=1, block_size=8, speculative_ngram=0), checkpoint=checkpoint)
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    ids = core.tokenizer.encode(f"<|im_start|>user\nLook:{pad}and{pad}<|im_end|>\n<|im_start|>assistant",
                                add_special_tokens=False)  # (Jinja drops the template's last newline)
    request = core.make_request(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                                images=[ImageInput.from_pil(random_image(*s, i)) for i, s in enumerate(SIZES)])
    core.add_request(request)
    while core.has_work():
        core.step()
    return core.tokenizer.decode(request.output_token_ids).strip(), len(request.prompt_token_ids)


def test_chat_images_and_a_text_only_template(qwen):
    answer, prompt_tokens = _expected(qwen)
    with serve(qwen, EngineConfig(parallel=2, block_size=8, speculative_ngram=0)) as served:
        assert httpx.get(f"{served.url}/props").json()["modalities"]["vision"] is True
        got = _chat(served)
    assert got["choices"][0]["message"]["content"].strip() == answer
    assert got["usage"]["prompt_tokens"] == prompt_tokens > 2 * 6  # both images' rows
    text_only = replace(qwen, tokenizer=replace(qwen.tokenizer, chat_template=TEXT_ONLY))
    with serve(text_only, EngineConfig(parallel=2, block_size=8, speculative_ngram=0)) as served:
        again = _chat(served)
    assert again["choices"][0]["message"]["content"].strip() == answer
    assert again["usage"]["prompt_tokens"] == prompt_tokens


def test_a_bad_image_is_a_400(qwen):
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}},
        {"type": "text", "text": "What is it?"}]}], "max_tokens": 2}
    with serve(qwen, EngineConfig(parallel=2, block_size=8, speculative_ngram=0)) as served:
        response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert httpx.post(f"{served.url}/v1/chat/completions", json={**body, "messages": [
            {"role": "user", "content": "hi"}]}, timeout=60).status_code == 200
