"""Offline Python API: LLM(model=...).chat(conversations, params), .generate(prompts, params) and .embed(texts).

chat() applies the model's chat template; generate() is raw completion of the text as given. Both
put every input into the one continuous batch of the engine at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from conveyor.config import EngineConfig, engine_config_from_env
from conveyor.engine.engine import EngineCore
from conveyor.engine.outputs import TokenLogprob
from conveyor.engine.sampling_params import SamplingParams
from conveyor.errors import InvalidRequestError
from conveyor.loading import Checkpoint
from conveyor.multimodal.image_input import ImageInput


@dataclass
class CompletionResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: str | None = None


# The knobs LLM() takes from the environment when not passed, as `conveyor serve` does: which build of the
# kernels runs (CONVEYOR_KERNEL_ARCH, _REQUIRE_KERNELS, _DISABLE_KERNEL). The kernel-level tests and tools
# select a level this way; every other setting is LLM()'s own keyword arguments.
KERNEL_FIELDS = ("kernel_arch", "require_kernels", "disable_kernel")


class LLM:
    def __init__(self, model: str | None = None, checkpoint: Checkpoint | None = None,
                 draft_checkpoint: Checkpoint | None = None, **config_fields) -> None:
        from_env = engine_config_from_env()
        for name in KERNEL_FIELDS:
            if config_fields.get(name) is None:
                config_fields[name] = getattr(from_env, name)
        self.engine = EngineCore(EngineConfig(model=model, **config_fields), checkpoint, draft_checkpoint)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """At the end: write the prefix cache to the disk tier (--prompt-cache-dir), if any, and stop its writer."""
        self.engine.close()

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 images: list[list[Any]] | None = None) -> list[CompletionResult]:
        """Raw completion: each prompt is continued as given (no chat template; for an instruct model
        use chat()). Every prompt runs through the continuous-batching engine at once; results in
        input order. `params` is one SamplingParams for all prompts or one per prompt. `images`: per prompt, its
        images (PIL or ImageInput), one per image marker in it (a vision model's, e.g. `<start_of_image>`)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        images_list = images or [[]] * len(prompts)
        results: dict[str, CompletionResult] = {}
        order = []
        for prompt, p, pictures in zip(prompts, params_list, images_list):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request = self.engine.make_request(ids, replace(p), images=[_image_input(i) for i in pictures])
            ids = request.prompt_token_ids  # with images: each marker expanded to the image's tokens
            self.engine.add_request(request)
            results[request.request_id] = CompletionResult(request.request_id, ids)
            order.append(request.request_id)
        while self.engine.has_work():
            for out in self.engine.step():
                result = results[out.request_id]
                result.token_ids += out.new_token_ids
                result.text += out.new_text
                result.logprobs += out.logprobs
                if out.finished:
                    result.finish_reason, result.error = out.finish_reason, out.error
                    result.num_cached_tokens = out.num_cached_tokens
        return [results[rid] for rid in order]

    def embed(self, texts: str | list[str] | list[list[int]]) -> list[list[float]]:
        """One vector per text (an embedding model, or one started with embeddings=True), in input order; all
        texts run through the continuous batch at once. A reranker (reranking=True) gives each text its score,
        a one-element list. Texts are tokenized with the model's special tokens, as sentence-transformers does."""
        if isinstance(texts, str) or (texts and isinstance(texts[0], int)):
            texts = [texts]  # type: ignore[list-item]
        order = []
        for text in texts:
            ids = self.tokenizer.encode(text) if isinstance(text, str) else list(text)
            request = self.engine.make_pooling_request(ids)
            self.engine.add_request(request)
            order.append(request.request_id)
        return self._pooled(order)

    def _pooled(self, order: list[str]) -> list[list[float]]:
        """Step until every request in `order` is pooled; their vectors in that order."""
        results: dict[str, list[float]] = {}
        while self.engine.has_work():
            for out in self.engine.step():
                if out.finished:
                    if out.pooled is None:
                        raise RuntimeError(f"embedding failed: {out.error}")
                    results[out.request_id] = out.pooled
        return [results[rid] for rid in order]

    def score(self, query: str, documents: list[str], instruction: str | None = None) -> list[float]:
        """A reranker's relevance of each document to `query` (in [0, 1], input order), read as /v1/rerank
        reads it: a cross-encoder's pair, or a yes/no reranker's prompt with `instruction`."""
        from conveyor.engine.rerank_prompt import pair_tokens

        if self.engine.pooling_task != "reranking":
            raise InvalidRequestError(f"{self.engine.model_name} is not a reranker (serve a cross-encoder, or start a "
                                      f"yes/no reranker with reranking=True)", "model")
        order = []
        for document in documents:
            ids, types = pair_tokens(self.tokenizer, self.engine.pooling, query, document, instruction)
            request = self.engine.make_pooling_request(ids, token_type_ids=types)
            self.engine.add_request(request)
            order.append(request.request_id)
        return [vector[0] for vector in self._pooled(order)]

    def chat(self, conversations: list[dict] | list[list[dict]],
             params: SamplingParams | list[SamplingParams] | None = None) -> CompletionResult | list[CompletionResult]:
        """Reply to one conversation (a list of {"role", "content"} messages) or to a list of them. A vision
        model's image goes in a content part {"type": "image", "image": PIL image}.

        The chat template is applied to each, then all run in one continuous batch through generate();
        one conversation gives one result, a list gives a list in input order.
        """
        single = not conversations or isinstance(conversations[0], dict)
        batch: list[list[dict]] = [conversations] if single else conversations  # type: ignore[list-item]
        prompts = [self._chat_prompt_ids(messages) for messages in batch]
        results = self.generate(prompts, params, [_chat_images(messages) for messages in batch])
        return results[0] if single else results

    def _chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(prompt, add_special_tokens=False)


def _image_input(image: Any) -> ImageInput:
    return image if isinstance(image, ImageInput) else ImageInput.from_pil(image)


def _chat_images(messages: list[dict]) -> list[Any]:
    """The images of a conversation's {"type": "image", "image": ...} parts, in the order its template writes them."""
    return [part["image"] for message in messages if isinstance(message.get("content"), list)
            for part in message["content"] if isinstance(part, dict) and part.get("type") == "image"]
