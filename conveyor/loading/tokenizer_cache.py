"""Tokenizers built once per file, so a model's load does not build one while other models stream.

Building a tokenizer is one long call into the Rust `tokenizers` library that holds the GIL throughout (a
49k-token BPE: ~30 ms from GGUF metadata, ~80 ms from tokenizer.json; a 128k or 262k vocabulary several
times that). A load beside streaming models runs at idle priority (engine/background.py), so such a call
there stretches into a 100-150 ms pause of every stream. The multi-model server turns the cache on and
builds the tokenizers of its catalog when it starts (server/multimodel/prefetch.py); every load of the same
unchanged file then takes the one built. Off elsewhere: a single-model process builds its one tokenizer once.
A `Tokenizer` is never changed after it is built, so engines share it. (A GGUF file's tokenizer is kept with
its header: loading/gguf_header.py.)
"""

from __future__ import annotations

from conveyor.loading.file_cache import FileCache, FileIdentity  # noqa: F401  (FileIdentity: this module's API before)
from conveyor.loading.tokenizer import Tokenizer


class TokenizerCache(FileCache[Tokenizer]):
    pass


TOKENIZERS = TokenizerCache()
