"""Load a llama.cpp GGUF file: weights under Hugging Face names, config and tokenizer.

Nothing is dequantized or copied here: float tensors are views of the file's mapping and block-quantized
ones stay GGML blocks (`QuantizedTensor`); the model decides per tensor what it keeps (models/weights.py)
and hands each tensor back to `release_pages` once it holds its own copy, so the file's pages leave RSS
tensor by tensor. Types the kernels do not run (Q2_K, Q3_K, IQ*, TQ*, ...) are dequantized there, with
one warning per type; a type gguf-py cannot dequantize either is a LoadError up front.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import warnings
from typing import Any
from dataclasses import replace

import gguf
import numpy as np
import torch

from conveyor.kernels.quant_ref import NATIVE_TYPES
from conveyor.loading.checkpoint import Checkpoint, LoadError, QuantizedTensor, Weight, select_weights
from conveyor.loading.gguf_config import config_from_gguf, field_value
from conveyor.loading.gguf_header import _Reader, read_header  # _Reader: tests open files with it too
from conveyor.loading.gguf_split import part_names, whole_name
from conveyor.loading.gguf_tokenizer import tokenizer_from_gguf
from conveyor.loading.heap import return_freed_heap, trim_heap
from conveyor.loading.tokenizer import Tokenizer
from conveyor.loading.tokenizer_cache import TOKENIZERS
from conveyor.models import family as families
from conveyor.models.config import ModelConfig
from conveyor.models.pooling import DenseSpec, PoolingConfig

# llama.cpp tensor name (without the `blk.N.` prefix) -> the shared decoder's Hugging Face module name; a family's
# gguf_tensors (models/family.py) add to these or, for the encoders, replace them.
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    # Gemma 2/3 and OLMo 2: norms after attention and after the MLP.
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q|k|v fused in the file
}
_DECODER_LAYERS = "model.layers."
# hidden_act xielu: the activation's four scalars per layer live in metadata arrays (raw, before softplus).
XIELU_KEYS = ("alpha_p", "alpha_n", "beta", "eps")
# Mixture of experts: the router, and each expert stack (E, N, K) split into E tensors under the family's names.
EXPERT_TENSORS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down",
                  "ffn_gate_up_exps": "gate_up"}  # convert_hf_to_gguf --fuse-gate-up-exps: gate rows, then up
# Tensors that only feed the config (rope_freqs, Phi-3's longrope factors -> rope_scaling).
CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# Quantization suffixes in file names, e.g. "SmolLM2-135M-Instruct.Q4_1.gguf" or "model-q4_k_m.gguf".
_QUANT_SUFFIX = re.compile(r"[.\-_](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)
_FLOAT_TYPES = {gguf.GGMLQuantizationType.F32: torch.float32, gguf.GGMLQuantizationType.F16: torch.float16,
                gguf.GGMLQuantizationType.BF16: torch.bfloat16}

_FAULT_AROUND = 2 * 1024 * 1024  # the largest page-cache folio a fault maps whole (a PMD)

logger = logging.getLogger(__name__)


def load_gguf(path: str) -> Checkpoint:
    """One GGUF file, or a split one from any of its parts (`NAME-00001-of-00003.gguf`, as llama.cpp's
    gguf-split and convert_hf_to_gguf --split-max-size write them: the metadata in the first)."""
    from conveyor.models import mtp  # (here: importing the loaders imports no family, tests/models/test_family.py)

    parts = split_parts(path)
    try:  # the multi-model server read the header when it started (gguf_header.py): then only the mapping is new
        header = read_header(parts)
    except (ValueError, OSError, IndexError) as exc:
        raise LoadError(f"{path}: not a readable GGUF file ({exc})") from exc
    readers = header.open(parts) if header is not None else _open(parts)
    reader = readers[0]
    if len(readers) > 1:
        _check_split(readers, parts)
        reader.tensors = [t for r in readers for t in r.tensors]  # each a view of its own part's mapping
    path = parts[0]
    config = config_from_gguf(reader, path)
    arch = field_value(reader, "general.architecture")
    family = families.for_gguf(arch)  # the names and transforms of the file's architecture (config_from_gguf's)
    mapping = _FileMappings([_FileMapping(r) for r in readers])
    del readers
    weights: dict[str, Weight] = {}
    dense: dict[str, gguf.gguf_reader.ReaderTensor] = {}
    own = family.gguf_weights(config, mapping.release) if family.gguf_weights is not None else None
    # The MTP head the converter appends as block N (Qwen3.5 / Qwen3-Next): named as one more layer of the family.
    own_mtp = family.gguf_weights(mtp.layer_config(config), mapping.release) if own is not None else None
    head: dict[str, Weight] = {}
    num_skipped = 0
    for tensor in reader.tensors:
        if tensor.name in CONFIG_TENSORS:
            continue
        layer = re.match(r"blk\.(\d+)\.", tensor.name)
        if layer is not None and int(layer.group(1)) >= config.num_hidden_layers:
            if own_mtp is not None and int(layer.group(1)) == config.num_hidden_layers:
                head.update(_mtp_tensor(config, own_mtp, tensor, path))
            else:  # a draft head we do not run
                num_skipped += 1
            continue
        if tensor.name.partition(".")[0] in GGUF_DENSE:
            dense[tensor.name] = tensor
            continue
        if config.num_experts and _is_moe_tensor(tensor.name):
            weights.update(_moe_weights(config, tensor, path))
            continue
        if own is not None:
            try:
                weights.update(own.weights(tensor.name, _to_torch(tensor, path)))
            except ValueError as exc:
                raise LoadError(f"{path}: {exc}") from exc
            continue
        name = hf_name(tensor.name, path, family)
        if "{}" in name:  # a stack in the file, one HF tensor per entry
            weights.update((name.format(i), weight) for i, weight in enumerate(_unstack(tensor, path)))
            continue
        weight = _to_torch(tensor, path)
        weights[name] = _unpermute(config, name, weight, mapping.release) if family.gguf_permuted_qk else weight
    if num_skipped:
        logger.info("%s: skipped %d tensors of the multi-token-prediction head", path, num_skipped)
    head = mtp.from_gguf_block(config, head) if head else {}
    if own is not None:
        own.report(path)
    if config.hidden_act == "xielu":
        weights.update(_xielu_weights(reader, config.num_hidden_layers, path))
    _warn_dequantized(reader)
    tokenizer = (header.tokenizer if header is not None else
                 TOKENIZERS.get_or_build([path], lambda: tokenizer_from_gguf(reader, path)))
    if tokenizer.eos_token_ids:
        # The tokenizer knows the end-of-turn tokens the template uses; metadata names only one.
        config = replace(config, eos_token_ids=tuple(tokenizer.eos_token_ids))
    pooling = _with_dense(gguf_pooling(field_value(reader, f"{arch}.pooling_type"), path), dense, path)
    mapping.release_all()  # metadata and vocabulary pages
    del reader
    # The reader's ~100k small metadata objects, before the weights are packed (a kept header made none: a full
    # collection would only hold the GIL ~0.1 s beside the streams).
    if header is None:
        return_freed_heap()
    else:
        trim_heap()
    return Checkpoint(config=config, weights=select_weights(config, weights, path), tokenizer=tokenizer,
                      source=path, name=model_name(path), release_pages=mapping.release, pooling=pooling,
                      mtp_weights=head)


def _open(parts: list[str]) -> list[_Reader]:
    readers = []
    for part in parts:
        try:
            readers.append(_Reader(part))
        except (ValueError, OSError, IndexError) as exc:
            raise LoadError(f"{part}: not a readable GGUF file ({exc})") from exc
    return readers


def read_gguf_tokenizer(path: str) -> Tokenizer:
    """A GGUF file's tokenizer alone (the metadata of a split file's first part), through the tokenizer cache;
    with the header cache on, read with the file's header (what the multi-model server reads ahead)."""
    parts = split_parts(path)
    header = read_header(parts)
    if header is not None:
        return header.tokenizer
    return TOKENIZERS.get_or_build([parts[0]], lambda: tokenizer_from_gguf(_Reader(parts[0]), parts[0]))


def _mtp_tensor(config: ModelConfig, own: Any, tensor: gguf.gguf_reader.ReaderTensor, source: str) -> dict[str, Weight]:
    """One tensor of the appended MTP block under the family's HF names (its nextn.* ones left as they are)."""
    if ".nextn." in tensor.name:
        return {tensor.name: _to_torch(tensor, source)}
    if config.num_experts and _is_moe_tensor(tensor.name):
        return _moe_weights(config, tensor, source)
    try:
        return own.weights(tensor.name, _to_torch(tensor, source))
    except ValueError as exc:
        raise LoadError(f"{source}: {exc}") from exc


# llama.cpp's llama_pooling_type, as its converter writes `{arch}.pooling_type` from sentence-transformers'
# pooling config: an embedding model's vectors (normalised, as llama-server returns them by default).
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
GGUF_POOLING_NONE, GGUF_POOLING_RANK = 0, 4


def gguf_pooling(value: Any, source: str) -> PoolingConfig | None:
    """The pooling a GGUF file declares (None: a generating model, or unpooled; rank: see --reranking)."""
    if value is None or int(value) in (GGUF_POOLING_NONE, GGUF_POOLING_RANK):
        return None
    if int(value) not in GGUF_POOLING:
        raise LoadError(f"{source}: unknown pooling_type {value} (llama.cpp's: 0 none, 1 mean, 2 cls, 3 last, 4 rank)")
    return PoolingConfig(pooling=GGUF_POOLING[int(value)])


# llama.cpp's build_dense_out: sentence-transformers' Dense layers after pooling, in this order, no activation
# (convert_hf_to_gguf --sentence-transformers-dense-modules writes EmbeddingGemma's 2_Dense and 3_Dense so).
GGUF_DENSE = ("dense_2", "dense_3")


def _with_dense(pooling: PoolingConfig | None, tensors: dict[str, gguf.gguf_reader.ReaderTensor],
                source: str) -> PoolingConfig | None:
    """The file's dense layers (`dense_2.weight`, an optional `.bias`, ...) added to its pooling, in fp32."""
    if not tensors:
        return pooling
    if pooling is None:
        raise LoadError(f"{source}: dense layers ({', '.join(sorted(tensors))}) but no pooling_type to apply them to")

    def dense(name: str) -> torch.Tensor | None:
        tensor = tensors.get(name)
        if tensor is None:
            return None
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)]))

    return replace(pooling, dense=tuple(DenseSpec(dense(f"{name}.weight"), dense(f"{name}.bias"))
                                        for name in GGUF_DENSE if f"{name}.weight" in tensors))


def hf_name(gguf_name: str, source: str = "", family: families.Family | None = None) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`, by the shared decoder's names and the
    family's gguf_tensors (an encoder's: its own alone, under its own layer prefix)."""
    own = family.gguf_tensors if family is not None else {}
    prefix = family.gguf_layer_prefix if family is not None else _DECODER_LAYERS
    names = own if prefix != _DECODER_LAYERS else {**GLOBAL_TENSORS, **BLOCK_TENSORS, **own}
    base, _, suffix = gguf_name.rpartition(".")
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if match is None and base in names:
        return f"{names[base]}.{suffix}"
    if match and match.group(2) in names:
        return f"{prefix}{match.group(1)}.{names[match.group(2)]}.{suffix}"
    if match and f"{match.group(2)}.{suffix}" in names:  # a whole name: a bare HF tensor (DeepSeek's exp_probs_b.bias)
        return f"{prefix}{match.group(1)}.{names[match.group(2) + '.' + suffix]}"
    raise LoadError(f"{source}: unexpected tensor {gguf_name!r} in GGUF file")


def _xielu_weights(reader: gguf.GGUFReader, num_layers: int, source: str) -> dict[str, torch.Tensor]:
    """`xielu.alpha_p` etc. (no architecture prefix; one value per layer, or one for all) as each layer's
    mlp.act_fn tensors."""
    weights = {}
    for key in XIELU_KEYS:
        values = field_value(reader, f"xielu.{key}")
        if values is None:
            raise LoadError(f"{source}: GGUF metadata lacks xielu.{key}")
        values = values if isinstance(values, list) else [values] * num_layers
        for layer, value in enumerate(values[:num_layers]):
            weights[f"model.layers.{layer}.mlp.act_fn.{key}"] = torch.tensor(float(value))
    return weights


def _is_moe_tensor(gguf_name: str) -> bool:
    """Routers and expert stacks with their biases (a `.scale` beside them is the family's: Gemma 4's)."""
    kind, suffix = gguf_name.split(".")[-2:]
    return kind in (*EXPERT_TENSORS, "ffn_gate_inp") and suffix in ("weight", "bias")


def _moe_weights(config: ModelConfig, tensor: gguf.gguf_reader.ReaderTensor, source: str) -> dict[str, Weight]:
    """`blk.N.ffn_gate_inp` -> the router; `blk.N.ffn_{gate,up,down}_exps` -> one (N, K) view per expert; their
    `.bias` (GPT-OSS) -> the router's bias and one (N,) view per expert."""
    layer, kind, suffix = tensor.name.split(".")[1:4]
    names, prefix = families.expert_names(config.architecture), f"model.layers.{layer}."
    if kind == "ffn_gate_inp":
        return {(names.router_bias if suffix == "bias" else names.router)(prefix): _to_torch(tensor, source)}
    if suffix == "bias":  # (E, N), always float
        biases = _to_torch(tensor, source)
        if not isinstance(biases, torch.Tensor) or biases.dim() != 2 or len(biases) != config.num_experts:
            raise LoadError(f"{source}: {tensor.name} is not a float ({config.num_experts}, N) tensor")
        return {names.expert_linear_bias(prefix, e, EXPERT_TENSORS[kind]): b for e, b in enumerate(biases)}
    shape = tuple(int(d) for d in reversed(tensor.shape))  # (E, N, K)
    if len(shape) != 3 or shape[0] != config.num_experts:
        raise LoadError(f"{source}: {tensor.name} has shape {shape}, expected ({config.num_experts}, rows, cols)")
    experts = _unstack(tensor, source)
    part = EXPERT_TENSORS[kind]
    if part != "gate_up":
        return {names.expert(prefix, e, part): weight for e, weight in enumerate(experts)}
    half = shape[1] // 2
    split = {}
    for e, weight in enumerate(experts):  # whole rows either side: views, blocks stay blocks
        split[names.expert(prefix, e, "gate")] = _rows(weight, 0, half)
        split[names.expert(prefix, e, "up")] = _rows(weight, half, shape[1])
    return split


def _unstack(tensor: gguf.gguf_reader.ReaderTensor, source: str) -> list[Weight]:
    """A (E, N, K) stack as E (N, K) views of the file (blocks stay blocks)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if len(shape) != 3:
        raise LoadError(f"{source}: {tensor.name} has shape {shape}, expected a stack of matrices")
    if tensor.tensor_type in _FLOAT_TYPES:
        stack = _view(tensor.data.view(np.uint8)).view(_FLOAT_TYPES[tensor.tensor_type]).reshape(shape)
        return list(stack.unbind(0))
    _check_dequantizable(tensor, shape[1:], source)
    stack = _view(tensor.data).reshape(shape[0], shape[1], -1)  # (E, N, row_bytes)
    return [QuantizedTensor(int(tensor.tensor_type), shape[1:], rows) for rows in stack.unbind(0)]


def _rows(weight: Weight, start: int, end: int) -> Weight:
    if isinstance(weight, QuantizedTensor):
        return QuantizedTensor(weight.qtype, (end - start, weight.shape[1]), weight.raw[start:end])
    return weight[start:end]


def model_name(path: str) -> str:
    stem = whole_name(os.path.basename(path)).removesuffix(".gguf")
    return _QUANT_SUFFIX.sub("", stem) or stem


def split_parts(path: str) -> list[str]:
    """Every part of the split GGUF `path` is one of, in order; [path] for a whole file."""
    parts = part_names(path)
    missing = [os.path.basename(p) for p in parts if not os.path.exists(p)]
    if missing:
        raise LoadError(f"{path} is one of {len(parts)} parts of a split GGUF; missing beside it: {', '.join(missing)}")
    return parts


def _check_split(readers: list[gguf.GGUFReader], parts: list[str]) -> None:
    """Each part says it is number i of n (gguf-split's split.* keys), and the parts hold every tensor."""
    for i, (reader, part) in enumerate(zip(readers, parts)):
        number, count = field_value(reader, "split.no"), field_value(reader, "split.count")
        if (number, count) != (i, len(parts)):
            raise LoadError(f"{part}: its metadata says part {number} of {count}, its name part {i} of {len(parts)}")
    expected = field_value(readers[0], "split.tensors.count")
    found = sum(len(r.tensors) for r in readers)
    if expected is not None and int(expected) != found:
        raise LoadError(f"{parts[0]}: the split GGUF's parts hold {found} tensors, its metadata says {expected}")


def _to_torch(tensor: gguf.gguf_reader.ReaderTensor, source: str) -> Weight:
    """A view of the file: float tensors keep their dtype, block-quantized ones stay GGML rows. HF shape order;
    a per-head stack (H, N, K) as one (H * N, K) matrix (the experts' and `{}` stacks are split before)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if len(shape) == 3:
        shape = (shape[0] * shape[1], shape[2])
    kind = tensor.tensor_type
    data = tensor.data
    if kind in _FLOAT_TYPES:
        return _view(data.view(np.uint8)).view(_FLOAT_TYPES[kind]).reshape(shape)
    if len(shape) != 2:
        raise LoadError(f"{source}: {tensor.name} is {kind.name} with {len(shape)} dimensions (expected a matrix)")
    _check_dequantizable(tensor, shape, source)
    return QuantizedTensor(int(kind), shape, _view(data).reshape(shape[0], -1))


def _check_dequantizable(tensor: gguf.gguf_reader.ReaderTensor, shape: tuple[int, ...], source: str) -> None:
    kind = tensor.tensor_type
    if kind in NATIVE_TYPES:
        return
    try:  # one row tells whether gguf-py can dequantize this type at all
        gguf.quants.dequantize(np.asarray(tensor.data).reshape(-1, tensor.data.shape[-1])[:1], kind)
    except NotImplementedError as exc:
        raise LoadError(f"{source}: {tensor.name} is {kind.name}, which neither the kernels nor gguf-py's "
                        "dequantizer support") from exc


def _view(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        # NOTE: the mapping is read-only; torch warns that such a tensor must not be written (it never is).
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _warn_dequantized(reader: gguf.GGUFReader) -> None:
    """One warning per GGML type the kernels do not run natively: such tensors are dequantized at model load."""
    by_type: dict[str, list[str]] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in _FLOAT_TYPES and tensor.tensor_type not in NATIVE_TYPES:
            by_type.setdefault(tensor.tensor_type.name, []).append(tensor.name)
    for kind, names in by_type.items():
        more = f" and {len(names) - 1} more tensors" if len(names) > 1 else ""
        logger.warning("%s%s are %s, which conveyor's kernels do not run: dequantized to the model dtype at "
                       "load (more memory, slower)", names[0], more, kind)


def _unpermute(config: ModelConfig, name: str, weight: Weight, release) -> Weight:
    """Undo convert_hf_to_gguf's rotary row interleave, which it applies to the q/k of LlamaModel and its subclasses
    only (weights and biases: the families with gguf_permuted_qk).

    Per head, HF keeps rows [x0..x(d/2-1) | y0..y(d/2-1)] (rotate-half); llama.cpp stores x0 y0 x1 y1 ...
    A quantized row is a whole output feature, so the same permutation moves raw block rows.
    """
    if not name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
        return weight
    heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
    rows = weight.raw if isinstance(weight, QuantizedTensor) else weight
    # (heads, d/2, 2, in) -> (heads, 2, d/2, in)
    permuted = rows.reshape(heads, rows.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(rows.shape).contiguous()
    release(rows)
    return QuantizedTensor(weight.qtype, weight.shape, permuted) if isinstance(weight, QuantizedTensor) else permuted


class _FileMappings:
    """A split GGUF's mappings, one per part: each tensor's pages released from the part it is a view of."""

    def __init__(self, mappings: list[_FileMapping]) -> None:
        self._mappings = mappings

    def holds(self, tensor: torch.Tensor) -> bool:
        return any(mapping.holds(tensor) for mapping in self._mappings)

    def release(self, tensor: torch.Tensor) -> None:
        for mapping in self._mappings:
            if mapping.holds(tensor):
                mapping.release(tensor)
                return

    def release_all(self) -> None:
        for mapping in self._mappings:
            mapping.release_all()


class _FileMapping:
    """The reader's mmap of the file: `release(tensor)` drops a view's pages from this process's RSS.

    MADV_DONTNEED on a read-only shared file mapping only unmaps the pages here; the page cache keeps them
    and a later read faults them back in, so releasing is always safe.
    """

    def __init__(self, reader: gguf.GGUFReader) -> None:
        array = reader.data
        while array is not None and not isinstance(array, np.memmap):
            array = array.base
        self._mmap = getattr(array, "_mmap", None) if array is not None else None
        self._start = array.ctypes.data if self._mmap is not None else 0
        self._size = len(self._mmap) if self._mmap is not None else 0

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a view of this file (not a copy, nor another checkpoint's tensor)."""
        return self._mmap is not None and 0 <= tensor.data_ptr() - self._start < self._size

    def release(self, tensor: torch.Tensor) -> None:
        if not self.holds(tensor) or not hasattr(mmap, "MADV_DONTNEED"):
            return
        offset = tensor.data_ptr() - self._start
        # NOTE: a read fault also maps cached neighbours (fault-around, whole large folios): widen the range,
        # or each tensor leaves its neighbours' edges resident (measured: 11 MB over SmolLM2's 272 tensors).
        start = max(offset - _FAULT_AROUND, 0)
        start -= start % mmap.PAGESIZE
        end = min(offset + tensor.numel() * tensor.element_size() + _FAULT_AROUND, self._size)
        self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def release_all(self) -> None:
        if self._mmap is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED, 0, self._size)
