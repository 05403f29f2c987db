"""Qwen3-VL over HTTP (DeepStack levels riding the image rows): chat image_url parts reach the model as the
template's <|vision_start|><|image_pad|><|vision_end|>, each pad expanded to the image's rows, with the engine's own
greedy answer; a text-only template gets the whole wrapped marker as text and the same answer; a bad image is a 400."""

import pytest
from tiny_qwen3_vl import random_image, write_model_dir
from vision_harness import check_bad_image_is_a_400, check_chat_and_text_only_template, with_template

from conveyor.loading.hf_loader import load_hf_dir

transformers = pytest.importorskip("transformers")

# Qwen's templates write <|vision_start|><|image_pad|><|vision_end|> for an image part
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
TEXT_ONLY = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "<|im_start|>assistant\n")
SIZES = [(50, 40), (33, 70)]
PAD = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_vl_server")
    write_model_dir(path, transformers)
    return with_template(load_hf_dir(str(path)), TEMPLATE)


def test_chat_images_and_a_text_only_template(qwen):
    # (Jinja drops the template's last newline)
    prompt = f"<|im_start|>user\nLook:{PAD}and{PAD}<|im_end|>\n<|im_start|>assistant"
    images = [random_image(*s, i) for i, s in enumerate(SIZES)]
    assert check_chat_and_text_only_template(qwen, TEXT_ONLY, prompt, images) > 2 * 6  # both images' rows


def test_a_bad_image_is_a_400(qwen):
    check_bad_image_is_a_400(qwen)
