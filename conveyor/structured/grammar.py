"""What a request constrains its output to, and its llguidance grammar text.

A `GrammarSpec` is plain data (it travels in `SamplingParams`); `to_llguidance()` turns it
into the grammar string llguidance compiles. Compilation and validation live in compiler.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import llguidance

GrammarKind = Literal["json_schema", "json_object", "regex", "lark", "choice"]

# json_object: any JSON object (OpenAI's JSON mode), written as a schema so one path serves both.
_ANY_OBJECT = {"type": "object"}
# Whitespace between JSON tokens: none would push small models off their usual spacing, unbounded
# runs of newlines let a weak model loop until max_tokens; one optional space after , and : is both.
JSON_OPTIONS: llguidance.JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                                "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    source: str  # a JSON schema (serialized), a regex, a Lark grammar, or a JSON list of choices

    @classmethod
    def json_schema(cls, schema: dict | bool) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema))  # key order kept: it is the order fields are written

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object", "")

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        return cls("choice", json.dumps(choices))

    def to_llguidance(self) -> str:
        """The grammar as llguidance takes it (may raise ValueError for a malformed schema)."""
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, overrides=JSON_OPTIONS)
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, overrides=JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        choices = json.loads(self.source)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
