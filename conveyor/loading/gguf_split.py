"""Split GGUF files as llama.cpp's gguf-split names them: `NAME-00001-of-00003.gguf` ... (the metadata in the
first part). Names only; loading/gguf_loader.py reads the parts, loading/hub.py downloads them."""

from __future__ import annotations

import re

SPLIT_SUFFIX = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


def part_names(name: str) -> list[str]:
    """Every part's name of the split GGUF `name` is a part of, in order; [name] for a whole file."""
    match = SPLIT_SUFFIX.search(name)
    if match is None:
        return [name]
    count, stem = int(match.group(2)), name[:match.start()]
    return [f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def whole_name(name: str) -> str:
    """`NAME-00002-of-00003.gguf` -> `NAME.gguf`; a whole file's name as it is."""
    return SPLIT_SUFFIX.sub(".gguf", name)


def is_later_part(name: str) -> bool:
    """A part after the first (the first one stands for the whole file)."""
    match = SPLIT_SUFFIX.search(name)
    return match is not None and int(match.group(1)) != 1
