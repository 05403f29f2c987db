"""Request bodies of the OpenAI-compatible and llama-server style endpoints (pydantic, strict).

Strict mode: a JSON string is never coerced into a number, nor a number into a bool, so a
wrong type is a 400 rather than a silent guess. Unknown fields are refused, except the
common OpenAI fields listed in each model that we accept and ignore.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted, ignored


class JSONSchemaFormat(_Body):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict | bool = Field(default_factory=dict, alias="schema")  # (BaseModel owns `schema`)
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_needed(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class FunctionDefinition(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: Annotated[str, Field(min_length=1)]  # data:image/...;base64,..., or http(s) / file where the server allows
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides the resolution


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL | Annotated[str, Field(min_length=1)]  # (vLLM also takes the bare URL string)

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    # Messages echo back whatever a client stored (tool_calls, refusal...): extra keys are ignored.
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: list[ContentPart] | str | None = None  # (a list first: a bad part's 400 names the part)
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    def image_parts(self) -> list[tuple[int, ImagePart]]:
        """(index in content, part) of each image, in order."""
        if not isinstance(self.content, list):
            return []
        return [(j, part) for j, part in enumerate(self.content) if isinstance(part, ImagePart)]


class SamplingFields(_Body):
    """Fields shared by chat and text completions."""

    model: str | None = None
    n: Annotated[int, Field(ge=1)] = 1  # at most --max-n (server/limits.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # JSON keys are strings: {"1234": -100}
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    priority: int | None = None  # higher runs first; overrides the X-Priority header
    cache_prompt: bool = True
    # llama-server's slot pin (-1: any). The prefix cache here is shared by every slot, so any slot reuses what a
    # pinned one would (a restored slot's blocks included): accepted, range-checked, otherwise ignored.
    id_slot: int | None = Field(default=None, ge=-1)
    # Accepted and ignored: they change nothing about generation here.
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Structured output beyond response_format, named as vLLM names them (at most one per request).
    guided_json: dict | str | None = None  # a JSON schema
    guided_regex: str | None = None
    guided_grammar: str | None = None  # Lark (llguidance dialect), or GBNF as llama-server takes it
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    response_format: ResponseFormat | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Extra variables for the chat template (vLLM's and llama-server's field), e.g. {"enable_thinking": false}
    # for Qwen3 / SmolLM3; on top of the server's --chat-template-kwargs.
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's field; reaches the template as `reasoning_effort` (GPT-OSS's harmony system message reads it).
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None


class CompletionRequest(SamplingFields):
    # One prompt or a batch; a prompt is text or token ids.
    prompt: str | Annotated[list[int], Field(min_length=1)] | Annotated[list[str], Field(min_length=1)] \
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
    logprobs: int | None = None
    echo: Literal[False] = False  # echoing the prompt would need prompt logprobs
    suffix: None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]


class TokenizeRequest(_Body):
    content: str | None = None
    prompt: str | None = None  # alias some clients send
    add_special: bool = False
    with_pieces: bool = False

    @model_validator(mode="after")
    def _one_text(self) -> TokenizeRequest:
        if (self.content is None) == (self.prompt is None):
            raise ValueError("give exactly one of content or prompt")
        return self

    @property
    def text(self) -> str:
        return self.content if self.content is not None else self.prompt  # type: ignore[return-value]


class DetokenizeRequest(_Body):
    tokens: list[int]


class ModelActionRequest(BaseModel):
    """POST /models/load and /models/unload (llama-server's router): the model's name."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str = Field(min_length=1)


# --- pooling endpoints (server/apis/embeddings.py) ----------------------------------------------------------
# OpenAI's own cap on inputs per embeddings request.
MAX_EMBEDDING_INPUTS = 2048
EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Body):
    """OpenAI's /v1/embeddings, with vLLM's truncate_prompt_tokens and sentence-transformers' prompt_name."""

    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None  # Matryoshka: the first N dims, renormalised
    user: str | None = None  # accepted, ignored
    # Keep only the last N tokens of a longer input (-1: as many as the context holds); unset: a longer input is a 400.
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    prompt_name: str | None = None  # one of the model's named prompts (Qwen3-Embedding's "query"), prepended
    add_special_tokens: bool = True
    priority: int | None = None


class LlamaEmbeddingRequest(_Body):
    """llama-server's /embedding: `content` (a string, token ids, or a list of them)."""

    content: EmbeddingInput
    model: str | None = None
    embd_normalize: int | None = None  # llama-server's; our vectors are the model's own (normalised where it is)
    priority: int | None = None


class RerankRequest(_Body):
    """/v1/rerank (Jina / Cohere shape, as llama-server and vLLM serve it)."""

    model_config = ConfigDict(extra="ignore", strict=True)  # clients add their own fields (Cohere's max_chunks...)
    query: str
    documents: Annotated[list[str | dict], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    model: str | None = None
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool = True
    instruction: str | None = None  # Qwen3-Reranker's task instruction
    priority: int | None = None


class ScoreRequest(_Body):
    """vLLM's /v1/score: text_1 against each of text_2 (one of them may be a single string)."""

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    instruction: str | None = None
    priority: int | None = None
