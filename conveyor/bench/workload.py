"""Prompts for the benchmark: synthetic word salad of a target length, or text from a file."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from conveyor.bench.client import RequestSpec

# Short common English words; with a leading space each is one token in the Llama/GPT-2/Qwen
# BPE vocabularies, so N words is roughly N prompt tokens.
_WORDS = tuple(dict.fromkeys(  # dict.fromkeys: drop repeats, keep order
    """
    the of and to in is was he for it with as his on be at by had are but from or have an they
    which one you were her all she there would their we him been has when who will more no if
    out so said what up its about into than them can only other new some could time these two
    may then do first any my now such like our over man me even most made after also did many
    before must through back years where much your way well down should because each just those
    people how too little state good very make world still own see men work long get here
    between both life being under never day same another know while last might us great old
    year off come since against go came right used take three small large next early young
    important few public bad same able hand high place house point water room mother area
    money story fact month lot book eye job word business issue side kind head far black
    long both white green red blue light sound river city tree night field rock horse paper
    """.split()
))


def _rng(seed: int, stream: int) -> random.Random:
    # One independent, reproducible stream per (seed, purpose) so levels never share prompts.
    return random.Random(seed * 1_000_003 + stream)


def synthetic_prompts(num_prompts: int, num_tokens: int, seed: int, stream: int = 0) -> list[str]:
    """`num_prompts` distinct prompts of about `num_tokens` tokens each, deterministic in (seed, stream).

    The first word is random too, so no two prompts share a prefix a server could cache.
    """
    rng = _rng(seed, stream)
    num_words = max(1, num_tokens)
    return [" ".join(rng.choices(_WORDS, k=num_words)) for _ in range(num_prompts)]


def load_prompt_file(path: str | Path) -> list[str]:
    """Paragraphs (blank-line separated) of a text file; single lines when it has no blank lines."""
    text = Path(path).read_text(encoding="utf-8")
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    if len(paragraphs) <= 1:
        paragraphs = [line.strip() for line in text.splitlines() if line.strip()]
    if not paragraphs:
        raise ValueError(f"prompt file {path} has no text")
    return paragraphs


def file_prompts(pool: list[str], num_prompts: int, offset: int = 0) -> list[str]:
    """`num_prompts` prompts taken in order from `pool` starting at `offset`, wrapping around."""
    return [pool[(offset + i) % len(pool)] for i in range(num_prompts)]


@dataclass(frozen=True)
class PromptSource:
    """Synthetic prompts of `num_tokens`, or paragraphs of a file when `pool` is given."""

    num_tokens: int
    seed: int
    pool: tuple[str, ...] = ()

    def prompts(self, num_prompts: int, stream: int) -> list[str]:
        if self.pool:
            # A file cannot give fresh text per stream; rotating the start at least varies the order.
            return file_prompts(list(self.pool), num_prompts, offset=stream * num_prompts)
        return synthetic_prompts(num_prompts, self.num_tokens, self.seed, stream)


@dataclass(frozen=True)
class Workload:
    """What every request of a run carries: prompts plus sampling parameters."""

    prompts: PromptSource
    max_tokens: int
    temperature: float = 0.0
    ignore_eos: bool = False

    def specs(self, num_requests: int, stream: int) -> list[RequestSpec]:
        return [
            RequestSpec(prompt, self.max_tokens, self.temperature, self.ignore_eos)
            for prompt in self.prompts.prompts(num_requests, stream)
        ]
