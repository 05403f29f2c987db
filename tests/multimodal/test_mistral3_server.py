"""Mistral 3 over HTTP: chat image_url parts reach the model as the template's [IMG] markers, each expanded to its
rows, with the engine's own greedy answer; a text-only template gets the marker as text and the same answer."""

import pytest
from tiny_mistral3 import random_image, write_model_dir
from vision_harness import check_chat_and_text_only_template, with_template

from conveyor.loading.hf_loader import load_hf_dir

transformers = pytest.importorskip("transformers")

# Mistral's templates write [IMG] for an image part
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST]{% if m['content'] is string %}"
            "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}[IMG]{% else %}"
            "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}[/INST]{% else %}{{ m['content'] }}</s>{% endif %}"
            "{% endfor %}")
TEXT_ONLY = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
             "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}")
SIZES = [(50, 40), (33, 70)]


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral3_server")
    write_model_dir(path, transformers, tie=False)
    return with_template(load_hf_dir(str(path)), TEMPLATE)


def test_chat_images_and_a_text_only_template(mistral3):
    prompt = "<s>[INST]Look:[IMG]and[IMG][/INST]"
    images = [random_image(i, s) for i, s in enumerate(SIZES)]
    assert check_chat_and_text_only_template(mistral3, TEXT_ONLY, prompt, images) > 2 * 6  # both images' rows
