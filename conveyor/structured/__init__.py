"""Structured output: grammars compiled by llguidance, per-row token masks, tool calls, reasoning text."""

from conveyor.structured.grammar import GrammarSpec

__all__ = ["GrammarSpec"]
