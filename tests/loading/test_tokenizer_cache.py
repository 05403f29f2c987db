"""The tokenizer cache (loading/tokenizer_cache.py): one tokenizer per unchanged file while it is on, a rewritten
file read again, nothing kept while it is off."""

from __future__ import annotations

import json
import os
import threading

import pytest

from conveyor.loading import load_checkpoint
from conveyor.loading.tokenizer_cache import TOKENIZERS, TokenizerCache
from conveyor.testing import write_tiny_model_dir


@pytest.fixture
def cache_on():
    TOKENIZERS.enabled = True
    yield TOKENIZERS
    TOKENIZERS.enabled = False
    TOKENIZERS.clear()


def test_off_every_load_builds_its_own(tmp_path):
    write_tiny_model_dir(tmp_path / "m", seed=0)
    assert load_checkpoint(tmp_path / "m").tokenizer is not load_checkpoint(tmp_path / "m").tokenizer
    assert len(TOKENIZERS) == 0


def test_on_loads_of_one_directory_share_its_tokenizer(tmp_path, cache_on):
    write_tiny_model_dir(tmp_path / "m", seed=0)
    first = load_checkpoint(tmp_path / "m").tokenizer
    assert load_checkpoint(tmp_path / "m").tokenizer is first
    assert len(cache_on) == 1


def test_a_changed_chat_template_is_read_again(tmp_path, cache_on):
    write_tiny_model_dir(tmp_path / "m", seed=0)
    first = load_checkpoint(tmp_path / "m").tokenizer
    config_path = tmp_path / "m" / "tokenizer_config.json"
    settings = json.loads(config_path.read_text()) if config_path.exists() else {}
    settings["chat_template"] = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    config_path.write_text(json.dumps(settings))
    (tmp_path / "m" / "chat_template.jinja").unlink(missing_ok=True)
    again = load_checkpoint(tmp_path / "m").tokenizer
    assert again is not first and again.chat_template == settings["chat_template"]
    assert len(cache_on) == 1  # the older version went


def test_a_gguf_file_s_tokenizer_is_read_once(cache_on):
    from conveyor.loading.default_model import default_model_path  # noqa: PLC0415
    from conveyor.loading.gguf_loader import read_gguf_tokenizer  # noqa: PLC0415

    first = read_gguf_tokenizer(default_model_path())
    assert read_gguf_tokenizer(default_model_path()) is first
    assert first.encode("Hello") == load_checkpoint(default_model_path()).tokenizer.encode("Hello")


def test_a_rewritten_file_is_a_new_entry(tmp_path):
    cache = TokenizerCache()
    cache.enabled = True
    source = tmp_path / "f"
    source.write_text("one")
    first = cache.get_or_build([str(source)], object)
    assert cache.get_or_build([str(source)], lambda: pytest.fail("built again")) is first
    source.write_text("three")
    os.utime(source, ns=(1, 1))  # a different mtime even where the clock is coarse
    assert cache.get_or_build([str(source)], object) is not first
    assert len(cache) == 1  # the older version went


def test_concurrent_callers_of_one_file_build_it_once(tmp_path):
    cache = TokenizerCache()
    cache.enabled = True
    source = tmp_path / "f"
    source.write_text("x")
    builds, entered, release = [], threading.Event(), threading.Event()

    def build():
        builds.append(1)
        entered.set()
        release.wait(30)
        return object()

    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get_or_build([str(source)], build)))
               for _ in range(4)]
    threads[0].start()
    assert entered.wait(30)
    for thread in threads[1:]:
        thread.start()
    release.set()
    for thread in threads:
        thread.join(30)
    assert len(builds) == 1 and len(results) == 4 and all(r is results[0] for r in results)
