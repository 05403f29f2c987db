"""Stable names of prefix blocks: a blake2b chain over each full block's token ids.

A block's key names its whole prefix (parent key + its tokens), the same in every process, so the RAM
prefix cache, the disk tier and saved slots share one key space. (Python's hash() of a tuple holding
None is address-based before 3.12, so it cannot name a file.) 128 bits: collisions are out of reach, and
RAM hits still compare the tokens themselves.

A block overlapping an image's span also folds in that image's content hash (multimodal/vision.py key_spans): two
prompts with the same placeholder tokens and different images never share a key. Text blocks keep the plain key.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

KEY_BYTES = 16


# (start, end, content hash bytes) of one image's span in the prompt
KeySpan = tuple[int, int, bytes]


def block_key(parent: int | None, tokens: Sequence[int], extra: bytes = b"") -> int:
    """The key of a block holding `tokens` after the prefix named `parent` (None: the first block); `extra`: the
    content hashes of the images the block overlaps."""
    head = parent.to_bytes(KEY_BYTES, "little") if parent is not None else b""
    body = struct.pack(f"<{len(tokens)}I", *tokens)
    digest = hashlib.blake2b(head + body + (b"img" + extra if extra else b""), digest_size=KEY_BYTES).digest()
    return int.from_bytes(digest, "little")


def chain_hashes(token_ids: Sequence[int], block_size: int, num_full_blocks: int,
                 start: int = 0, parent: int | None = None, spans: Sequence[KeySpan] = ()) -> list[int]:
    """Keys of blocks [start, num_full_blocks) of token_ids, chained from `parent` (the key of block start-1)."""
    keys = []
    for i in range(start, num_full_blocks):
        lo, hi = i * block_size, (i + 1) * block_size
        extra = b"".join(digest for first, end, digest in spans if first < hi and end > lo)
        parent = block_key(parent, token_ids[lo:hi], extra)
        keys.append(parent)
    return keys


def key_hex(key: int) -> str:
    return key.to_bytes(KEY_BYTES, "little").hex()
