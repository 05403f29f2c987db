"""`load_checkpoint`: pick the loader from what the path is."""

from __future__ import annotations

import os

from conveyor.loading.checkpoint import Checkpoint, LoadError
from conveyor.loading.default_model import default_model_path
from conveyor.loading.gguf_loader import load_gguf
from conveyor.loading.hf_loader import load_hf_dir


def load_checkpoint(path: str | os.PathLike | None = None) -> Checkpoint:
    """None -> the default model; a directory -> Hugging Face format; a *.gguf file -> GGUF."""
    resolved = os.path.realpath(os.path.expanduser(os.fspath(path))) if path is not None else default_model_path()
    if os.path.isdir(resolved):
        return load_hf_dir(resolved)
    if not os.path.exists(resolved):
        raise LoadError(f"model path not found: {path}")
    if resolved.endswith(".gguf"):
        return load_gguf(resolved)
    raise LoadError(f"{path}: expected a model directory (config.json + *.safetensors) or a .gguf file")
