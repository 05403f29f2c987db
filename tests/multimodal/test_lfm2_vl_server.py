"""LFM2-VL over HTTP: chat image_url parts reach the model as the template's `<image>` (as LFM2-VL's template writes
it), each expanded to the image's run (one split into tiles + thumbnail, one whole), with the engine's own greedy
answer; a text-only template gets `<image>` as text and the same answer."""

import pytest
from tiny_lfm2_vl import random_image, write_model_dir
from vision_harness import check_bad_image_is_a_400, check_chat_and_text_only_template, with_template

from conveyor.loading.hf_loader import load_hf_dir

transformers = pytest.importorskip("transformers")

TEMPLATE = ("<|startoftext|>{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
            "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
            "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n")
TEXT_ONLY = ("<|startoftext|>{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
             "{% endfor %}<|im_start|>assistant\n")
SIZES = [(50, 40), (20, 30)]  # split (2 x 2 + thumbnail), whole


@pytest.fixture(scope="module")
def lfm2_vl(tmp_path_factory):
    path = tmp_path_factory.mktemp("lfm2_vl_server")
    write_model_dir(path, transformers)
    return with_template(load_hf_dir(str(path)), TEMPLATE)


def test_chat_images_and_a_text_only_template(lfm2_vl):
    prompt = ("<|startoftext|><|im_start|>user\nLook:<image>and<image><|im_end|>\n"
              "<|im_start|>assistant")  # (Jinja drops the last newline)
    images = [random_image(*s, i) for i, s in enumerate(SIZES)]
    assert check_chat_and_text_only_template(lfm2_vl, TEXT_ONLY, prompt, images) > 5 * 4 + 8  # both images' runs


def test_a_bad_image_is_a_400(lfm2_vl):
    check_bad_image_is_a_400(lfm2_vl, b"hello", text=None)
