"""Images through the real HTTP app on a tiny random Gemma 3 (tests/multimodal/tiny_gemma3_vision.py): chat's
image_url parts, Anthropic's image blocks and Responses' input_image parts through the official SDKs give the
engine's own greedy answer for those images in that order; every bad image is a 400 that says what is wrong;
concurrent image requests == one at a time and leave no KV block behind; a text model answers images with a 400."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import pytest
from PIL import Image

from conveyor.config import EngineConfig, ServerConfig
from conveyor.engine.engine import EngineCore
from conveyor.engine.sampling_params import SamplingParams
from conveyor.multimodal.image_input import ImageInput
from tests.multimodal.image_files import animated_gif, data_url, encoded, picture, png, png_header_only
from tests.multimodal.tiny_gemma3_vision import NUM_EMBEDS, write_model_dir
from tests.server.conftest import serve

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 6
IMAGES = [png(seed, (40 + 8 * seed, 30)) for seed in range(4)]  # PNG bytes: lossless, so the pixels are known
URLS = [data_url(b) for b in IMAGES]


def _image(i: int) -> dict:
    return {"type": "image_url", "image_url": {"url": URLS[i]}}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_vision_api")
    write_model_dir(path, transformers)
    return str(path)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    path = tmp_path_factory.mktemp("media")
    (path / "a.png").write_bytes(IMAGES[0])
    return path


@pytest.fixture(scope="module")
def seeing(model_dir, media):
    config = ServerConfig(metrics=True, max_images=3, max_image_bytes=60_000, max_image_pixels=20_000,
                          allowed_local_media_path=str(media))
    with serve(None, EngineConfig(model=model_dir, parallel=4, block_size=8, speculative_ngram=0), config) as s:
        yield s


@pytest.fixture(scope="module")
def engine(model_dir):
    """The same checkpoint in its own engine: what the server should answer, computed without the API."""
    return EngineCore(EngineConfig(model=model_dir, parallel=1, block_size=8, speculative_ngram=0,
                                   enable_prefix_caching=False))


def _expected(core: EngineCore, messages: list[dict] | str, images: list[int]) -> str:
    """Greedy text for `messages` (template image parts) with IMAGES[i] for i in `images`, straight on the engine."""
    text = messages if isinstance(messages, str) else core.tokenizer.apply_chat_template(messages,
                                                                                         add_generation_prompt=True)
    ids = core.tokenizer.encode(text, add_special_tokens=False)
    inputs = [ImageInput.from_pil(picture(i, (40 + 8 * i, 30))) for i in images]
    request = core.make_request(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                                images=inputs)
    core.add_request(request)
    while core.has_work():
        core.step()
    # (strip: a one-shot decode drops the leading space the server's incremental detokenizer keeps)
    return core.tokenizer.decode(request.output_token_ids).strip()


def _chat(served, messages: list[dict], ignore_eos: bool = True) -> str:
    reply = served.client().chat.completions.create(model=served.model, messages=messages, max_tokens=MAX_TOKENS,
                                                    temperature=0, extra_body={"ignore_eos": ignore_eos})
    return reply.choices[0].message.content.strip()


def _idle_and_clean(served) -> None:
    served.wait_until(lambda: not served.core.has_work(), what="idle engine")
    served.core.kv.check_integrity()
    assert served.core.pool.stats().num_used == 0


def test_props_says_the_model_sees(seeing, served):
    assert httpx.get(f"{seeing.url}/props").json()["modalities"]["vision"] is True
    assert httpx.get(f"{served.url}/props").json()["modalities"]["vision"] is False


def test_chat_images_reach_the_model_in_order(seeing, engine):
    parts = [_text("Look:"), _image(0), _text("and"), _image(1), _text("Same?")]
    answer = _chat(seeing, [{"role": "user", "content": parts}])
    template = [_text("Look:"), {"type": "image"}, _text("and"), {"type": "image"}, _text("Same?")]
    assert answer == _expected(engine, [{"role": "user", "content": template}], [0, 1])
    several = seeing.client().chat.completions.create(  # n choices: each its own engine request with the images
        model=seeing.model, messages=[{"role": "user", "content": parts}], max_tokens=MAX_TOKENS, temperature=0, n=2,
        extra_body={"ignore_eos": True})
    assert [c.message.content.strip() for c in several.choices] == [answer, answer]
    swapped = [_text("Look:"), _image(1), _text("and"), _image(0), _text("Same?")]
    assert _chat(seeing, [{"role": "user", "content": swapped}]) != answer
    _idle_and_clean(seeing)


def test_images_in_earlier_turns_and_streaming(seeing, engine):
    messages = [{"role": "user", "content": [_image(2), _text("First?")]}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [_text("Then"), _image(3)]}]
    template = [{"role": "user", "content": [{"type": "image"}, _text("First?")]},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": [_text("Then"), {"type": "image"}]}]
    expected = _expected(engine, template, [2, 3])
    assert _chat(seeing, messages) == expected
    stream = seeing.client().chat.completions.create(model=seeing.model, messages=messages, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip() == expected


def test_anthropic_and_responses_sdks_send_images(seeing):
    # (the other APIs have no ignore_eos: the chat answer may end early too)
    chat = _chat(seeing, [{"role": "user", "content": [_image(0), _image(1), _text("What?")]}], ignore_eos=False)
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": URLS[i].split(",")[1]}}
              for i in (0, 1)]
    client = anthropic.Anthropic(base_url=seeing.url, api_key="unused", max_retries=0)
    message = client.messages.create(model=seeing.model, max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": blocks + [_text("What?")]}])
    assert message.content[0].text.strip() == chat
    # count_tokens counts each image's whole run (NUM_EMBEDS soft tokens + its markers), as the usage does
    counted = client.messages.count_tokens(model=seeing.model, messages=[{"role": "user", "content": blocks + [
        _text("What?")]}])
    usage = message.usage  # (Anthropic's input_tokens leave out the prefix-cache hit: the chat request's)
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens > 2 * NUM_EMBEDS
    content = [{"type": "input_image", "image_url": URLS[i], "detail": "auto"} for i in (0, 1)]
    response = seeing.client().responses.create(model=seeing.model, max_output_tokens=MAX_TOKENS, temperature=0,
                                                input=[{"role": "user", "content": content + [
                                                    {"type": "input_text", "text": "What?"}]}])
    assert response.output_text.strip() == chat
    _idle_and_clean(seeing)


def test_images_inside_anthropic_tool_results(seeing, engine):
    """A tool_result's image blocks reach the model in the tool message, as Anthropic passes them: the answer is the
    one chat gives for that tool message with image_url parts, and the engine's own for that templated turn."""
    client = anthropic.Anthropic(base_url=seeing.url, api_key="unused", max_retries=0)

    def ask(i: int):
        result = [_text("Here:"), {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                               "data": URLS[i].split(",")[1]}}]
        return client.messages.create(model=seeing.model, max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                                      messages=[{"role": "user", "content": "Fetch the picture."},
                                                {"role": "assistant", "content": [_text("Fetching."), {
                                                    "type": "tool_use", "id": "toolu_1", "name": "fetch",
                                                    "input": {}}]},
                                                {"role": "user", "content": [{"type": "tool_result",
                                                                              "tool_use_id": "toolu_1",
                                                                              "content": result}]}])
    message = ask(2)
    chat = _chat(seeing, [{"role": "user", "content": "Fetch the picture."},
                          {"role": "assistant", "content": "Fetching.", "tool_calls": [
                              {"id": "toolu_1", "type": "function", "function": {"name": "fetch", "arguments": "{}"}}]},
                          {"role": "tool", "tool_call_id": "toolu_1", "content": [_text("Here:"), _image(2)]}],
                 ignore_eos=False)
    assert message.content[0].text.strip() == chat
    # The template renders no tool turns: the plan's fallback writes the result as a user <tool_response> turn, the
    # image's marker inside it.
    prompt = ("<bos><start_of_turn>user\nFetch the picture.<end_of_turn>\n<start_of_turn>model\nFetching.\n<tool_call>\n"
              '{"name": "fetch", "arguments": {}}\n</tool_call><end_of_turn>\n<start_of_turn>user\n<tool_response>\n'
              "Here:<start_of_image>\n</tool_response><end_of_turn>\n<start_of_turn>model\n")
    assert message.stop_reason == "end_turn" or message.content[0].text.strip() == _expected(engine, prompt, [2])
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > NUM_EMBEDS
    assert ask(3).content[0].text != message.content[0].text  # the image is seen
    _idle_and_clean(seeing)


def test_images_inside_responses_function_call_outputs(seeing):
    """A function_call_output's input_image parts reach the model in the tool message, as chat's image_url parts do:
    the Responses answer is the chat answer for the same conversation, and the image is seen."""
    def ask(i: int):
        return seeing.client().responses.create(model=seeing.model, max_output_tokens=MAX_TOKENS, temperature=0, input=[
            {"role": "user", "content": "Fetch the picture."},
            {"type": "function_call", "call_id": "call_1", "name": "fetch", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": [
                {"type": "input_text", "text": "Here:"}, {"type": "input_image", "image_url": URLS[i]}]}])
    response = ask(2)
    chat = _chat(seeing, [{"role": "user", "content": "Fetch the picture."},
                          {"role": "assistant", "content": "", "tool_calls": [
                              {"id": "call_1", "type": "function", "function": {"name": "fetch", "arguments": "{}"}}]},
                          {"role": "tool", "tool_call_id": "call_1", "content": [_text("Here:"), _image(2)]}],
                 ignore_eos=False)
    assert response.output_text.strip() == chat
    assert response.usage.input_tokens > NUM_EMBEDS
    assert ask(3).output_text != response.output_text  # the image is seen
    _idle_and_clean(seeing)


def test_a_file_url_and_the_bare_url_string(seeing, media):
    expected = _chat(seeing, [{"role": "user", "content": [_image(0), _text("What?")]}])
    assert _chat(seeing, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"file://{media}/a.png"}}, _text("What?")]}]) == expected
    assert _chat(seeing, [{"role": "user", "content": [  # vLLM's shorter form
        {"type": "image_url", "image_url": URLS[0]}, _text("What?")]}]) == expected


def test_a_stored_response_replays_its_images(seeing):
    client = seeing.client()
    first = client.responses.create(model=seeing.model, max_output_tokens=2, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": URLS[1]}, {"type": "input_text", "text": "What?"}]}])
    second = client.responses.create(model=seeing.model, max_output_tokens=2, previous_response_id=first.id,
                                     input="And now?")
    assert second.usage.input_tokens > first.usage.input_tokens > NUM_EMBEDS  # the image is in both prompts
    assert second.usage.input_tokens_details.cached_tokens > NUM_EMBEDS  # its blocks came from the prefix cache


def test_concurrent_image_requests_equal_one_at_a_time(seeing):
    jobs = [[{"role": "user", "content": [_image(i % 4), _text(f"Picture {i}?")] +
              ([_image((i + 1) % 4)] if i % 3 == 0 else [])}] for i in range(8)]
    alone = [_chat(seeing, messages) for messages in jobs]

    async def together() -> list[str]:
        async with seeing.async_client() as client:
            replies = await asyncio.gather(*(client.chat.completions.create(
                model=seeing.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True}) for messages in jobs))
        return [r.choices[0].message.content.strip() for r in replies]
    assert asyncio.run(together()) == alone
    _idle_and_clean(seeing)


def _bad(part: dict) -> list[dict]:
    return [{"role": "user", "content": [_text("What?"), part]}]


def _url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize("messages, match", [
    (_bad(_url(data_url(IMAGES[0][:300]))), "image 1 is corrupt or truncated"),
    (_bad(_url(data_url(b"just some text"))), "not an image"),
    (_bad(_url(data_url(encoded(picture(1), "TIFF"), "image/tiff"))), "unsupported image format TIFF"),
    (_bad(_url(data_url(animated_gif(), "image/gif"))), "animated"),
    (_bad(_url(data_url(encoded(Image.new("RGB", (200, 150)))))), "--max-image-pixels"),
    (_bad(_url(data_url(png_header_only(1 << 20, 1 << 20)))), "too many pixels"),
    (_bad(_url(data_url(bytes(70_000)))), "--max-image-bytes"),
    (_bad(_url("data:image/png;base64,%%%")), "not valid base64"),
    (_bad(_url("ftp://example.com/a.png")), "scheme ftp"),
    (_bad(_url("https://example.com/a.png")), "--allow-remote-images"),
    (_bad(_url("file:///etc/hostname")), "--allowed-local-media-path"),
    ([{"role": "user", "content": [_image(0), _image(1), _image(2), _image(3)]}], "4 images; at most 3"),
    ([{"role": "system", "content": [_image(0)]}, {"role": "user", "content": "x"}], "user messages"),
    (_bad({"type": "image_url", "image_url": {"url": URLS[0], "detail": "huge"}}), "detail"),
    (_bad({"type": "video_url", "video_url": {"url": URLS[0]}}), "type"),
])
def test_bad_images_are_a_400_naming_the_part(seeing, messages, match):
    r = httpx.post(f"{seeing.url}/v1/chat/completions", timeout=60,
                   json={"model": seeing.model, "messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert match in error["message"] or match in (error["param"] or ""), error
    assert error["param"], error


def test_a_bad_image_in_the_other_apis_is_their_400(seeing):
    bad = data_url(b"not a picture").split(",")[1]
    r = httpx.post(f"{seeing.url}/v1/messages", timeout=60, json={
        "model": seeing.model, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": bad}}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "image 1: the data is not an image" in r.json()["error"]["message"]
    r = httpx.post(f"{seeing.url}/v1/responses", timeout=60, json={
        "model": seeing.model, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "file:///etc/hostname"}]}]})
    assert r.status_code == 400 and "--allowed-local-media-path" in r.json()["error"]["message"], r.text
    _idle_and_clean(seeing)


def test_a_text_model_refuses_images_in_every_api(served):
    r = httpx.post(f"{served.url}/v1/chat/completions", timeout=60, json={
        "model": served.model, "max_tokens": 2, "messages": _bad(_image(0))})
    assert r.status_code == 400 and "does not accept images" in r.json()["error"]["message"], r.text
    client = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="does not accept images"):
        client.messages.create(model=served.model, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
