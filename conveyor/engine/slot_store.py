"""llama-server's slot persistence (--slot-save-path), mapped onto the prefix cache's disk store.

A slot here is a position in the running batch (server/observability.py); between requests it keeps the
tokens of the last request that ran there (EngineCore.slot_contents). Saving a slot writes its whole
blocks to the disk store (the same files the disk tier uses) plus a small manifest, `<save path>/<filename>`,
naming the token ids (for models with a sliding group or recurrent state, up to where those can resume
too: the sliding blocks and the state snapshot are saved with them). Restoring reads the manifest and brings
those blocks into the RAM prefix cache, so the next request with that prefix is a hit. Erasing drops the
slot's blocks from the RAM prefix cache (as llama-server erases the slot's KV; the saved file stays).

Every function here runs on the engine thread (AsyncEngine.call) and answers in llama-server's JSON shapes.
"""

from __future__ import annotations

import json
import os
import re
import time

from conveyor.engine.block_keys import chain_hashes

MANIFEST_FORMAT = "conveyor-slot-1"
# llama.cpp's fs_validate_filename in spirit: one plain name, no separators, no "..", nothing hidden.
_FILENAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")


class SlotError(Exception):
    """A refused slot action: `status` is the HTTP code llama-server answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def check_filename(directory: str, filename: object) -> str:
    """The manifest's path, or SlotError(400) for anything but one plain file name inside `directory`."""
    if not isinstance(filename, str) or not _FILENAME.fullmatch(filename) or ".." in filename:
        raise SlotError(400, "Invalid filename")
    root = os.path.realpath(directory)
    path = os.path.realpath(os.path.join(root, filename))
    if os.path.dirname(path) != root:  # a symlink pointing out, say
        raise SlotError(400, "Invalid filename")
    return path


def slot_token_ids(core, slot_id: int) -> list[int]:
    """The tokens whose KV the slot holds (or last held)."""
    if not 0 <= slot_id < core.max_batch_size:
        raise SlotError(400, "Invalid slot ID")
    content = core.slot_contents.get(slot_id)
    if content is None:
        return []
    if isinstance(content, list):  # restored into the slot
        return content
    return content.all_token_ids[:content.num_computed_tokens]


def save(core, slot_id: int, directory: str, filename: object) -> dict:
    started = time.perf_counter()
    path = check_filename(directory, filename)
    tokens = slot_token_ids(core, slot_id)
    num_saved, written = core.kv.save_prefix(tokens)
    saved = tokens[:num_saved]
    manifest = {"format": MANIFEST_FORMAT, "tag": core.disk.store.tag, "token_ids": saved}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f)
    os.replace(tmp, path)
    return {"id_slot": slot_id, "filename": filename, "n_saved": len(saved), "n_written": written,
            "timings": {"save_ms": round((time.perf_counter() - started) * 1e3, 3)}}


def restore(core, slot_id: int, directory: str, filename: object) -> dict:
    started = time.perf_counter()
    path = check_filename(directory, filename)
    if not 0 <= slot_id < core.max_batch_size:
        raise SlotError(400, "Invalid slot ID")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise SlotError(404, f"slot file {filename!r} not found") from None
    except (OSError, ValueError):
        raise SlotError(400, f"slot file {filename!r} is not a saved slot") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise SlotError(400, f"slot file {filename!r} is not a saved slot")
    if manifest.get("tag") != core.disk.store.tag:
        raise SlotError(400, f"slot file {filename!r} was saved by another model or KV layout")
    tokens = manifest.get("token_ids")
    vocab = core.model_config.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in tokens):
        raise SlotError(400, f"slot file {filename!r} has invalid token ids")
    read_before = core.disk.store.stats.num_read_bytes
    restored = core.kv.warm_prefix(tokens)
    core.slot_contents[slot_id] = tokens[:restored]
    read = core.disk.store.stats.num_read_bytes - read_before
    return {"id_slot": slot_id, "filename": filename, "n_restored": restored, "n_read": read,
            "timings": {"restore_ms": round((time.perf_counter() - started) * 1e3, 3)}}


def erase(core, slot_id: int) -> dict:
    """Forget the slot's content and drop its blocks from the RAM prefix cache where no request holds them."""
    tokens = slot_token_ids(core, slot_id)
    if slot_id < len(core.scheduler.running):
        raise SlotError(400, "slot is processing a request")
    size = core.kv.block_size
    keys = chain_hashes(tokens, size, len(tokens) // size)
    blocks = [b for i, key in enumerate(keys)
              if (b := core.pool.lookup(key, tuple(tokens[i * size:(i + 1) * size]))) is not None]
    core.pool.uncache(blocks)
    core.slot_contents.pop(slot_id, None)
    return {"id_slot": slot_id, "n_erased": len(tokens)}
