"""llama.cpp's projector tensor names -> the Hugging Face checkpoint's, by table: the one renaming every
loading/mmproj_*.py uses.

A GGUF name is a stem and a kind (`v.blk.3.attn_q` + `weight`): the table maps whole stems, and the parts of tower
block N (`v.blk.N.<part>`) through one per-part table. A tensor the table does not know is a load error naming it:
dropping it would run a tower that differs from the one the file describes (a newer converter's extra tensor).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from conveyor.loading.checkpoint import LoadError

_BLOCK = re.compile(r"v\.blk\.(\d+)\.(.+)")
_MAX_LISTED = 5  # unknown tensors named in the error; a wholly foreign file would list hundreds


@dataclass(frozen=True)
class TensorNames:
    """One projector type's names. `block` is HF's stem of tower block N with `{}` for N
    ("model.visual.blocks.{}"); `unused` are whole names the converter writes for llama.cpp's own graph."""

    stems: Mapping[str, str]  # llama.cpp's stem -> HF's
    block: str = ""
    block_parts: Mapping[str, str] = field(default_factory=dict)  # a part inside v.blk.N -> HF's inside block N
    unused: frozenset[str] = frozenset()

    def hf_name(self, name: str) -> str | None:
        """`name`'s HF name, None where the table does not know it."""
        stem, _, kind = name.rpartition(".")
        if stem in self.stems:
            return f"{self.stems[stem]}.{kind}"
        match = _BLOCK.fullmatch(stem)
        if match and match[2] in self.block_parts:
            return f"{self.block.format(match[1])}.{self.block_parts[match[2]]}.{kind}"
        return None


def rename_tensors(tensors: Mapping[str, torch.Tensor], names: TensorNames, path: str,
                   projector: str) -> dict[str, torch.Tensor]:
    """`tensors` (GGUF names) under their HF names; a LoadError naming the tensors `names` does not know."""
    renamed: dict[str, torch.Tensor] = {}
    unknown = []
    for name, tensor in tensors.items():
        if name in names.unused:
            continue
        hf = names.hf_name(name)
        if hf is None:
            unknown.append(name)
        else:
            renamed[hf] = tensor
    if unknown:
        listed = ", ".join(unknown[:_MAX_LISTED])
        more = f" and {len(unknown) - _MAX_LISTED} more" if len(unknown) > _MAX_LISTED else ""
        raise LoadError(f"{path}: unknown tensor{'s' if len(unknown) > 1 else ''} {listed}{more} in a {projector} "
                        "projector (not a file this loader can run)")
    return renamed
