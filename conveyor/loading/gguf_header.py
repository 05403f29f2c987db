"""A GGUF file's header (metadata and tensor table) and tokenizer, read once per unchanged file.

Parsing the header is Python under the GIL (~75 ms for a 49k vocabulary, whose strings and merges are ~100k
objects; several times that for 128k-262k), and freeing those objects takes a full gc.collect() (~100 ms,
one call holding the GIL). A load beside streaming models runs at idle priority, where such work stretches
into pauses of every stream (benchmarks/results.md, issue #40). So the multi-model server reads each catalog
file's header when it starts (server/multimodel/prefetch.py) and keeps it here without the file's mapping
and without the tokenizer's arrays (the tokenizer is built from them first); a load then maps the file and
rebuilds the tensor views from the kept table (~5 ms). Off elsewhere (loading/file_cache.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from conveyor.loading.file_cache import FileCache
from conveyor.loading.gguf_tokenizer import tokenizer_from_gguf
from conveyor.loading.tokenizer import Tokenizer
from conveyor.loading.tokenizer_cache import TOKENIZERS

# Metadata the tokenizer build alone reads (arrays of a vocabulary's size): not kept once it is built.
_TOKENIZER_ARRAYS = "tokenizer.ggml."


class _Reader(gguf.GGUFReader):
    # NOTE: slicing np.memmap costs microseconds per slice and GGUFReader slices once per vocab string;
    # a plain ndarray view of the same mapping opens SmolLM2 in 1 s instead of 4 s.
    def _get(self, *args, **kwargs):
        if type(self.data) is np.memmap:
            self.data = self.data.view(np.ndarray)
        return super()._get(*args, **kwargs)

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        # NOTE: gguf-py reads an array one element at a time through two numpy views each: Gemma 3's
        # 262k-token vocabulary (three such arrays) took ~6 s. Flat string and number arrays are read in
        # one pass here, into the same parts layout (one part per element) that field_value() reads.
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        itype, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        kind, n, start = gguf.GGUFValueType(int(itype[0])), int(count[0]), orig_offs + 12
        if kind == gguf.GGUFValueType.STRING:
            view, offs, parts = memoryview(self.data), start, []
            for _ in range(n):
                length = int.from_bytes(view[offs:offs + 8], "little")
                parts.append(bytes(view[offs + 8:offs + 8 + length]))
                offs += 8 + length
            return offs - orig_offs, [itype, count, *parts], list(range(2, 2 + n)), [gguf.GGUFValueType.ARRAY, kind]
        nptype = self.gguf_scalar_to_np.get(kind)
        if nptype is None:  # arrays of arrays
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(start, nptype, n)
        return (12 + int(values.nbytes), [itype, count, *values.reshape(n, 1)], list(range(2, 2 + n)),
                [gguf.GGUFValueType.ARRAY, kind])


@dataclass(frozen=True)
class PartHeader:
    """One file's parse, held without its mapping: its fields and tensor-info records, every array copied."""

    fields: OrderedDict[str, gguf.ReaderField]
    tensor_fields: tuple[gguf.ReaderField, ...]
    byte_order: str
    alignment: int
    data_offset: int
    endianess: Any

    @classmethod
    def of(cls, reader: _Reader) -> PartHeader:
        fields = OrderedDict((name, _detached(field)) for name, field in reader.fields.items()
                             if not (name.startswith(_TOKENIZER_ARRAYS) and field.types[0] == gguf.GGUFValueType.ARRAY))
        return cls(fields, tuple(_detached(t.field) for t in reader.tensors), reader.byte_order,
                   int(reader.alignment), int(reader.data_offset), reader.endianess)

    def open(self, path: str) -> _Reader:
        """A reader of `path` as if parsed: the file mapped, the tensors views of it (gguf-py's own layout)."""
        reader = _Reader.__new__(_Reader)
        reader.data = np.memmap(path, mode="r")
        reader.byte_order, reader.alignment, reader.endianess = self.byte_order, self.alignment, self.endianess
        reader.data_offset = self.data_offset
        reader.fields = self.fields  # shared, never changed
        reader._build_tensors(self.data_offset, list(self.tensor_fields))
        return reader


@dataclass(frozen=True)
class GGUFHeader:
    parts: tuple[PartHeader, ...]
    tokenizer: Tokenizer

    def open(self, paths: list[str]) -> list[_Reader]:
        return [part.open(path) for part, path in zip(self.parts, paths)]


HEADERS: FileCache[GGUFHeader] = FileCache()


def read_header(paths: list[str]) -> GGUFHeader | None:
    """The header of the GGUF file whose parts are `paths`, read once (None while the cache is off: a load then
    parses the file itself). Raises what gguf-py raises for a file that is not GGUF."""
    if not HEADERS.enabled:
        return None
    return HEADERS.get_or_build(paths, lambda: _read(paths))


def _read(paths: list[str]) -> GGUFHeader:
    readers = [_Reader(path) for path in paths]
    tokenizer = TOKENIZERS.get_or_build([paths[0]], lambda: tokenizer_from_gguf(readers[0], paths[0]))
    return GGUFHeader(tuple(PartHeader.of(reader) for reader in readers), tokenizer)


def _detached(field: gguf.ReaderField) -> gguf.ReaderField:
    """The field with its arrays copied out of the file's mapping (which then closes with its reader)."""
    parts = [np.array(part) if isinstance(part, np.ndarray) else part for part in field.parts]
    return field._replace(parts=parts)
