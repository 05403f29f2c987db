"""Model loading: Hugging Face directories and GGUF files -> config, HF-named weights, tokenizer."""

from conveyor.loading.checkpoint import Checkpoint, LoadError, expected_weight_names
from conveyor.loading.default_model import default_model_path
from conveyor.loading.loader import load_checkpoint
from conveyor.loading.tokenizer import Tokenizer

__all__ = ["Checkpoint", "LoadError", "Tokenizer", "default_model_path", "expected_weight_names", "load_checkpoint"]
