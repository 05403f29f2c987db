"""What every vision family's engine and server tests share, written once.

Engine: an EngineCase (a tiny checkpoint's directory, its image jobs, their sampling params) runs the jobs one at a
time and all at once, with a small chunk budget and under preemption; every run checks that each KV block came back.
Server: a chat with image_url parts against the engine's own greedy answer (its text, and its logprobs bitwise),
through the family's template and a text-only one; a corrupt image is a 400 and the server still answers.

Each family file keeps its own jobs, prompts and family-specific checks (named after this module, not `harness`:
pytest imports test helpers by bare module name, and tests/cluster has a cluster_harness)."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
from PIL import Image

from conveyor.config import EngineConfig
from conveyor.engine.engine import EngineCore
from conveyor.engine.sampling_params import SamplingParams
from conveyor.multimodal.image_input import ImageInput
from tests.server.conftest import serve

Job = tuple[str, list[ImageInput]]  # (prompt text with the family's image markers, its images)
Trace = list[tuple[int, float]]  # one request's (token, logprob) per generated token

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
# The engine tests' shape: 16 slots (every job in one batch), small blocks so an image spans several
ENGINE_FIELDS = dict(parallel=16, block_size=8, speculative_ngram=0)


def sixteen_jobs(single: str, pair: str, images: list[ImageInput],
                 pairs: tuple[tuple[int, int], ...] = ((1, 3), (3, 1))) -> list[Job]:
    """14 one-image jobs (`single` formatted with {i}, cycling through `images`, so several share one) + one
    two-image job per pair of indices (`pair` holds two markers)."""
    jobs = [(single.format(i=i), [images[i % len(images)]]) for i in range(14)]
    return jobs + [(pair, [images[a], images[b]]) for a, b in pairs]


def tokens(trace: Trace) -> list[int]:
    return [t for t, _ in trace]


def run_requests(core: EngineCore, requests: list) -> None:
    """Add `requests`, step until the engine is idle, then check that no KV block leaked."""
    for request in requests:
        core.add_request(request)
    while core.has_work():
        core.step()
    check_no_leak(core)


def check_no_leak(core: EngineCore) -> None:
    core.kv.check_integrity()
    assert core.pool.stats().num_used == 0


def run_traces(core: EngineCore, requests: list) -> list[Trace]:
    """Add `requests` (made with logprobs), step until idle; each one's (token, logprob) trace; no block leaked."""
    for request in requests:
        core.add_request(request)
    traces: dict[str, Trace] = {r.request_id: [] for r in requests}
    while core.has_work():
        for out in core.step():
            traces[out.request_id] += [(lp.token_id, lp.logprob) for lp in out.logprobs]
    check_no_leak(core)
    return [traces[r.request_id] for r in requests]


def run_tokens(core: EngineCore, jobs: list[Job], params: SamplingParams = PARAMS,
               tokenizer: Any = None) -> list[list[int]]:
    """All jobs at once; each one's generated token ids. `tokenizer` (default: the core's) encodes the prompts: a
    GGUF pair's test gives both engines the directory's ids."""
    tokenizer = tokenizer or core.tokenizer
    requests = [core.make_request(tokenizer.encode(text, add_special_tokens=False), params, images=images)
                for text, images in jobs]
    run_requests(core, requests)
    return [r.output_token_ids for r in requests]


@dataclass(frozen=True)
class EngineCase:
    """One family's engine test setup: its tiny checkpoint directory, the jobs, the distinct images they use."""

    model_dir: str
    jobs: list[Job]
    images: list[ImageInput]
    params: SamplingParams = field(default_factory=lambda: PARAMS)

    def core(self, **fields: Any) -> EngineCore:
        return EngineCore(EngineConfig(model=self.model_dir, **{**ENGINE_FIELDS, **fields}))

    def run(self, core: EngineCore, jobs: list[Job] | None = None) -> list[Trace]:
        """All `jobs` (default: the case's) at once; each one's (token, logprob) trace; no block leaked."""
        jobs = self.jobs if jobs is None else jobs
        return run_traces(core, [core.make_request(core.tokenizer.encode(text, add_special_tokens=False),
                                                   self.params, images=images) for text, images in jobs])

    def alone(self, **fields: Any) -> list[Trace]:
        """Each job by itself, no prefix cache: what every batched run must equal bitwise."""
        core = self.core(enable_prefix_caching=False, **fields)
        return [self.run(core, [job])[0] for job in self.jobs]

    def encode_up_front(self, core: EngineCore) -> None:
        """Every image through the tower first, so all the jobs are admitted at once (else the tower's pace spreads
        their admissions over several steps)."""
        ids = core.tokenizer.encode(self.jobs[0][0], add_special_tokens=False)
        for image in self.images:
            core.runner.encoder_cache.get(core.make_request(ids, self.params, images=[image]).images[0])

    def check_concurrent(self, alone: list[Trace], up_front: bool = False, **fields: Any) -> EngineCore:
        """All jobs at once (prefix cache on) == one at a time, bitwise; each distinct image encoded once."""
        core = self.core(**fields)
        if up_front:
            self.encode_up_front(core)
        assert self.run(core) == alone
        assert core.runner.encoder_cache.num_encoded == len(self.images)
        return core

    def check_chunk_budget(self, alone: list[Trace], chunk: int = 3) -> None:
        """A prefill chunk budget smaller than an image's run (chunks end inside it) == one at a time, bitwise."""
        core = self.core(prefill_chunk_size=chunk, enable_prefix_caching=False)
        assert self.run(core) == alone

    def check_preemption(self, alone: list[Trace], num_blocks: int = 64, **fields: Any) -> None:
        """A pool of `num_blocks` too small for every row at once: rows are preempted and re-prefilled (their
        images' rows taken again from the encoder cache), the output still == one at a time, bitwise."""
        plan = self.core(enable_prefix_caching=False).pool_plan
        budget = plan.window_pool_bytes + num_blocks * plan.bytes_per_block
        tight = self.core(enable_prefix_caching=False, kv_cache_budget=str(budget), **fields)
        self.encode_up_front(tight)
        assert self.run(tight) == alone
        assert tight.scheduler.stats.num_preemptions > 0


def mmproj_core(checkpoint, mmproj: str, **fields: Any) -> EngineCore:
    """The checkpoint's text model with its own tower dropped and llama.cpp's projector file beside it instead."""
    text_only = replace(checkpoint, vision=None)
    return EngineCore(EngineConfig(mmproj=mmproj, **{**ENGINE_FIELDS, **fields}), checkpoint=text_only)


def gguf_pair_core(text_gguf: str, mmproj: str, **fields: Any) -> EngineCore:
    """llama-server's pair: a text GGUF + its mmproj, fp32."""
    return EngineCore(EngineConfig(model=text_gguf, mmproj=mmproj, **{**ENGINE_FIELDS, "dtype": "float32", **fields}))


# --- over HTTP ---

SERVER_FIELDS = dict(parallel=2, block_size=8, speculative_ngram=0)


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def post_chat(served, parts: list[dict], **fields: Any) -> dict:
    """One user message of `parts`, the body's other `fields` as given; asserts a 200."""
    body = {"messages": [{"role": "user", "content": parts}], **fields}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def with_template(checkpoint, template: str):
    return replace(checkpoint, tokenizer=replace(checkpoint.tokenizer, chat_template=template))


def engine_answer(checkpoint, prompt: str, images: list[Image.Image], max_tokens: int) -> tuple[str, int, list[float]]:
    """The engine's own greedy answer to `prompt` (the template's rendering, markers in place) with `images`: the
    stripped text, the expanded prompt's length and each generated token's logprob."""
    core = EngineCore(EngineConfig(parallel=1, block_size=8, speculative_ngram=0), checkpoint=checkpoint)
    request = core.make_request(core.tokenizer.encode(prompt, add_special_tokens=False),
                                SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0),
                                images=[ImageInput.from_pil(image) for image in images])
    (trace,) = run_traces(core, [request])
    return core.tokenizer.decode(tokens(trace)).strip(), len(request.prompt_token_ids), [lp for _, lp in trace]


def check_chat_and_text_only_template(checkpoint, text_only: str, prompt: str, images: list[Image.Image],
                                      max_tokens: int = 6) -> int:
    """Two image_url parts ("Look:" [image 0] "and" [image 1]) through the checkpoint's template == the engine's
    answer to `prompt` (what that template renders): the same text and, bitwise, the same logprobs (a tiny random
    model's words may not change with the images; its logprobs do); /props says vision. Through `text_only` (a
    template that renders no image parts) the parts become the marker text: the same answer. Returns the prompt
    length, for the family's own bound on it."""
    answer, prompt_tokens, logprobs = engine_answer(checkpoint, prompt, images, max_tokens)
    parts = [{"type": "text", "text": "Look:"}, image_part(data_url(images[0])), {"type": "text", "text": "and"},
             image_part(data_url(images[1]))]
    fields = dict(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=True)
    with serve(checkpoint, EngineConfig(**SERVER_FIELDS)) as served:
        assert httpx.get(f"{served.url}/props").json()["modalities"]["vision"] is True
        got = post_chat(served, parts, **fields)
    with serve(with_template(checkpoint, text_only), EngineConfig(**SERVER_FIELDS)) as served:
        again = post_chat(served, parts, **fields)
    for response in (got, again):
        choice = response["choices"][0]
        assert choice["message"]["content"].strip() == answer
        assert [entry["logprob"] for entry in choice["logprobs"]["content"]] == logprobs
        assert response["usage"]["prompt_tokens"] == prompt_tokens
    return prompt_tokens


def check_bad_image_is_a_400(checkpoint, data: bytes = b"not a png", text: str | None = "What is it?") -> None:
    """An image_url part whose bytes are no image is a 400; the server still answers a plain chat after it."""
    parts = [image_part("data:image/png;base64," + base64.b64encode(data).decode())]
    parts += [{"type": "text", "text": text}] if text is not None else []
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    with serve(checkpoint, EngineConfig(**SERVER_FIELDS)) as served:
        response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert httpx.post(f"{served.url}/v1/chat/completions", json={**body, "messages": [
            {"role": "user", "content": "hi"}]}, timeout=60).status_code == 200
