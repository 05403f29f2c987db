"""Idefics3 / SmolVLM over HTTP: chat image_url parts reach the model as the template's `<image>` (as SmolVLM's
template writes it), each expanded to its tiles' and global frame's runs, with the engine's own greedy answer; a
text-only template gets `<image>` as text and the same answer; a corrupt image is a 400."""

import pytest
from tiny_idefics3 import random_image, write_model_dir
from vision_harness import check_bad_image_is_a_400, check_chat_and_text_only_template, with_template

from conveyor.loading.hf_loader import load_hf_dir

transformers = pytest.importorskip("transformers")

TEMPLATE = ("<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}:{% if m['content'] is string %}"
            "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}"
            "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}Assistant:")
TEXT_ONLY = ("<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}:{{ m['content'] }}<end_of_utterance>\n"
             "{% endfor %}Assistant:")
SIZES = [(50, 40), (20, 30)]  # split (2 x 2 tiles + the global frame), whole


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    path = tmp_path_factory.mktemp("idefics3_server")
    write_model_dir(path, transformers, split=True)
    return with_template(load_hf_dir(str(path)), TEMPLATE)


def test_chat_images_and_a_text_only_template(idefics3):
    prompt = "<|im_start|>User:Look:<image>and<image><end_of_utterance>\nAssistant:"
    images = [random_image(i, s) for i, s in enumerate(SIZES)]
    assert check_chat_and_text_only_template(idefics3, TEXT_ONLY, prompt, images) > 5 * 4 + 4  # both images' runs


def test_a_bad_image_is_a_400(idefics3):
    check_bad_image_is_a_400(idefics3)
