"""Grammar compilation with a cache, and the per-request matcher state.

Compiling a JSON schema builds its lexer against the whole vocabulary (milliseconds to
hundreds of them); requests with the same schema (an agent's tool set, a pydantic model)
start from a deep copy of the cached matcher instead.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance

from conveyor.errors import InvalidRequestError
from conveyor.loading import Tokenizer
from conveyor.structured.grammar import GrammarSpec


@dataclass
class CompilerStats:
    num_compiled: int = 0
    num_cache_hits: int = 0
    compile_seconds: float = 0.0  # total time spent compiling (cache misses only)
    last_compile_seconds: float = 0.0


class GrammarState:
    """One request's position in its grammar; advanced by every accepted output token."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.error: str | None = None

    def accept(self, token_id: int) -> bool:
        if self.error is None and not self.matcher.consume_token(token_id):
            self.error = f"constrained decoding: token {token_id} rejected ({self.matcher.get_error()})"
        return self.error is None

    @property
    def is_done(self) -> bool:
        """The grammar is complete and admits nothing more (not even EOS is needed)."""
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Validates and compiles grammars for one tokenizer; thread-safe (server threads compile)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 64,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        # Every id that ends a request counts as EOS for the grammar, as it does for the engine.
        eos = sorted(set(tokenizer.eos_token_ids) | set(eos_token_ids))
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                eos_token=eos or None)
        self.cache_size = cache_size
        self.stats = CompilerStats()
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The cached, never-advanced matcher of `spec`; InvalidRequestError names what is wrong."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self.stats.num_cache_hits += 1
                return hit
        start = time.perf_counter()
        matcher = self._build(spec)  # outside the lock: llguidance drops the GIL while it compiles
        elapsed = time.perf_counter() - start
        with self._lock:
            self.stats.num_compiled += 1
            self.stats.compile_seconds += elapsed
            self.stats.last_compile_seconds = elapsed
            if self.cache_size > 0:
                self._cache[spec] = matcher
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return matcher

    def new_state(self, spec: GrammarSpec) -> GrammarState:
        return GrammarState(self.compile(spec).deep_copy())

    def _build(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        try:
            grammar = spec.to_llguidance()
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"invalid {_WHAT[spec.kind]}: {exc}", _PARAM[spec.kind]) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise InvalidRequestError(f"invalid {_WHAT[spec.kind]}: {_first_line(messages)}", _PARAM[spec.kind])
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {_WHAT[spec.kind]}: {matcher.get_error()}", _PARAM[spec.kind])
        return matcher


_WHAT = {"json_schema": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
         "lark": "grammar", "choice": "choice list"}
# The request field to name in a 400 (the server renames where its field differs).
_PARAM = {"json_schema": "response_format", "json_object": "response_format", "regex": "guided_regex",
          "lark": "guided_grammar", "choice": "guided_choice"}


def _first_line(messages: Sequence[str]) -> str:
    return messages[0].strip() if messages else "rejected by the grammar compiler"
