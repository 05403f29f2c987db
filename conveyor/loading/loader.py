"""`load_checkpoint`: pick the loader from what the path is (a Hugging Face Hub name is fetched first)."""

from __future__ import annotations

import os

from conveyor.loading.checkpoint import Checkpoint, LoadError
from conveyor.loading.default_model import default_model_path
from conveyor.loading.gguf_loader import load_gguf, read_gguf_tokenizer
from conveyor.loading.hf_loader import load_hf_dir, read_hf_dir_tokenizer
from conveyor.loading.hub import DownloadReport, resolve_model


def load_checkpoint(path: str | os.PathLike | None = None, *, hf_file: str | None = None,
                    revision: str | None = None, on_download: DownloadReport | None = None) -> Checkpoint:
    """None -> the default model; a directory -> Hugging Face format; a *.gguf file -> GGUF;
    ORG/NAME[:QUANT] (not a local path) -> downloaded from the Hub (on_download(bytes, total) as it
    goes), then one of those."""
    path = resolve_model(os.fspath(path) if path is not None else None, hf_file, revision, on_download)
    given = os.path.abspath(os.path.expanduser(path)) if path is not None else default_model_path()
    resolved = os.path.realpath(given)
    if os.path.isdir(resolved):
        return load_hf_dir(resolved)
    if not os.path.exists(resolved):
        raise LoadError(f"model path not found: {path}")
    if given.endswith(".gguf") or resolved.endswith(".gguf"):
        # NOTE: the link's path, not realpath: a Hub cache file links to a blob named by its hash.
        return load_gguf(given)
    raise LoadError(f"{path}: expected a model directory (config.json + *.safetensors) or a .gguf file")


def prefetch_tokenizer(path: str | None) -> bool:
    """Build a local model's tokenizer into loading/tokenizer_cache.py's cache ahead of its load (the multi-model
    server, at start), and a GGUF file's header with it where that cache is on (loading/gguf_header.py); None is
    the default model; a Hub name or a missing path is left to the load (nothing is downloaded here).
    Whether one was built (or already there)."""
    given = os.path.abspath(os.path.expanduser(path)) if path is not None else default_model_path()
    if os.path.isdir(given):
        read_hf_dir_tokenizer(os.path.realpath(given))  # the path load_checkpoint reads it from
        return True
    if os.path.isfile(given) and given.endswith(".gguf"):
        read_gguf_tokenizer(given)
        return True
    return False
