"""Per-request sampling parameters, validated before a request is admitted."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conveyor.errors import InvalidRequestError

if TYPE_CHECKING:
    from conveyor.structured.grammar import GrammarSpec


GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k >= 0 = chosen token plus k alternatives
    seed: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured: GrammarSpec | None = None  # constrained decoding (JSON schema, regex, grammar); None = free

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        # Below GREEDY_TEMPERATURE, logits / temperature overflow to +-inf (NaN in the softmax), so such a
        # temperature means greedy, as in vLLM (its _SAMPLING_EPS).
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, vocab_size: int | None = None) -> None:
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be at least 1", "max_tokens")
        _check(self.temperature >= 0.0, "temperature must be non-negative", "temperature")
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k must be -1, 0 (disabled) or positive", "top_k")
        _check(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", "min_p")
        _check(self.repetition_penalty > 0.0, "repetition_penalty must be positive", "repetition_penalty")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]", "presence_penalty")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]", "frequency_penalty")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be between 0 and 20", "logprobs")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings", "stop")
        # A torch.Generator takes any seed in [-2^63, 2^64); beyond it the seeding would fail inside the forward.
        _check(self.seed is None or -(1 << 63) <= self.seed < (1 << 64), "seed must fit in 64 bits", "seed")
        for token_id, bias in self.logit_bias.items():
            _check(isinstance(token_id, int) and (vocab_size is None or 0 <= token_id < vocab_size),
                   f"logit_bias token id {token_id!r} is out of the vocabulary", "logit_bias")
            _check(-100.0 <= bias <= 100.0, "logit_bias values must be in [-100, 100]", "logit_bias")
        if vocab_size is not None:
            _check(all(0 <= t < vocab_size for t in self.stop_token_ids), "stop_token_ids out of vocabulary",
                   "stop_token_ids")


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param)
