"""Building blocks shared by the model families: norms, rotary embeddings, row-invariant linears, quantized embeddings."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from conveyor.kernels import KernelBackend
from conveyor.kernels.quant_ref import type_name
from conveyor.models.config import ModelConfigError
from conveyor.models.tensors import QuantizedTensor


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: KernelBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): a residual add fused into the norm that follows it."""
        return self.ops.add_rms_norm(x, delta, self.weight, self.eps)


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias (the encoders', BERT's), in fp32 and rounded back once, as torch's
    bf16 kernel does. torch's CPU kernel reduces each row on its own, so a row's bits do not depend on its batch."""

    def __init__(self, size: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        # meta placeholders: loading assigns them (models/weights.py); no bias: ModernBERT's norm_bias=False
        self.weight = nn.Parameter(torch.empty(size, device="meta"), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(size, device="meta"), requires_grad=False) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, size) -> (T, size)
        bias = None if self.bias is None else self.bias.float()
        return nn.functional.layer_norm(x.float(), self.weight.shape, self.weight.float(), bias, self.eps).to(x.dtype)


@dataclass(frozen=True)
class QuantSegment:
    """Output rows [start, start + rows) of a linear in one GGML type, packed for the quantized kernel."""

    qtype: int
    start: int
    rows: int
    packed: torch.Tensor  # opaque: the kernel's layout (KernelBackend.pack_quantized)
    bias_f32: torch.Tensor | None = None

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)


def pack_segments(parts: list[QuantizedTensor], ops: KernelBackend) -> tuple[QuantSegment, ...]:
    """One segment per run of parts sharing a type: fused q|k|v or gate|up of one type is one GEMM.

    Rows are concatenated before packing (a copy of those rows, freed once packed).
    """
    segments, start, i = [], 0, 0
    while i < len(parts):
        j = i
        while j < len(parts) and parts[j].qtype == parts[i].qtype:
            j += 1
        run = parts[i:j]
        raw = run[0].raw if len(run) == 1 else torch.cat([p.raw for p in run])
        rows = raw.shape[0]
        segments.append(QuantSegment(run[0].qtype, start, rows, ops.pack_quantized(raw, run[0].qtype, run[0].shape[1])))
        start, i = start + rows, j
    return tuple(segments)


class RowInvariantLinear(nn.Module):
    """y = x W^T (+ b), with each row's bits independent of how many rows share the call.

    CPU GEMM libraries switch kernels with the row count M (measured here: oneDNN's bf16 rows
    are bitwise stable only up to M=32, fp32 only at M=1), which would make a request's output
    depend on its batch-mates. On CPU in bf16 we run our own GEMM (kernels/csrc/gemm.cpp, AMX,
    AVX-512 BF16, AVX2 or portable C++): every output element is one fixed reduction over k
    whatever M is, so no tiling is needed, and it streams the weights at close to memory
    bandwidth (oneDNN reached ~40% at M=1). GGML block-quantized weights (Q4_K, Q8_0, ...) run the
    quantized kernel, row-invariant the same way. Elsewhere the weight is prepacked for oneDNN and
    run in row tiles of `row_tile` rows, found by calibrate_row_tile(); None means one call.

    One copy: once a packed (or int8, or quantized) form exists, `weight` is None.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: KernelBackend) -> None:
        super().__init__()
        self.ops = ops
        self.in_features, self.out_features = in_features, out_features
        # Placeholders on the meta device (no memory): loading assigns real tensors (models/weights.py).
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device="meta"), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device="meta"), requires_grad=False) if bias else None
        self.row_tile: int | None = None
        self.dtype: torch.dtype | None = None  # the weight's dtype before packing (activations match it)
        self._packed: torch.Tensor | None = None
        self._bf16_packed: torch.Tensor | None = None  # our kernel's layout (see bf16_linear_pack)
        self._bias_f32: torch.Tensor | None = None  # our kernels add the bias in fp32
        self._int8: tuple[torch.Tensor, torch.Tensor] | None = None  # (weight (out, in) int8, per-row scale)
        self.segments: tuple[QuantSegment, ...] = ()  # GGML blocks, in output row order

    def load_dense(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Hold a dense (out, in) weight (and bias); prepack() or quantize_int8() may then replace it."""
        self.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            self.bias = nn.Parameter(bias, requires_grad=False)

    def load_quantized(self, segments: tuple[QuantSegment, ...]) -> None:
        """Run on GGML blocks (from pack_segments, or a tied embedding's): the only copy of the weight."""
        bias = None if self.bias is None else self.bias.data.float()
        self.segments = tuple(replace(s, bias_f32=None if bias is None else bias[s.start:s.start + s.rows])
                              for s in segments)
        self.weight, self.dtype = None, torch.bfloat16

    def quantize_int8(self) -> bool:
        """Weight-only int8 (symmetric, one scale per output row): half the bytes streamed per step.

        Only on CPU with bf16/fp32 activations, where torch has the int8-weight GEMM; the kernel is
        row-invariant at every M measured (1..64), so batch invariance survives.
        """
        w = self.weight.data
        if w.device.type != "cpu" or w.dtype not in (torch.bfloat16, torch.float32):
            return False
        scale = w.float().abs().amax(dim=1).clamp(min=1e-8) / 127.0
        q = (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self._int8 = (q.contiguous(), scale.to(w.dtype))
        self._packed = self._bf16_packed = None
        self.weight, self.dtype = None, w.dtype
        return True

    @property
    def row_invariant_kernel(self) -> bool:
        """Whether this linear runs one of our own kernels, row-invariant at every M (no tiling needed)."""
        return self._bf16_packed is not None or bool(self.segments)

    def prepack(self) -> bool:
        """Pack the weight once for the fastest path here (our bf16 GEMM, else oneDNN) and drop it; whether it did."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.bfloat16:
            return False
        self._bf16_packed = self.ops.pack_linear(w.data)
        if self._bf16_packed is not None:
            self._bias_f32 = None if self.bias is None else self.bias.data.float()
            self.weight, self.dtype = None, w.dtype
            return True
        if not torch.backends.mkldnn.is_available():
            return False
        try:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.data, 32)
        except (RuntimeError, AttributeError):
            self._packed = None
        if self._packed is None:
            return False
        self.weight, self.dtype = None, w.dtype
        return True

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.segments:
            return self._quantized_matmul(x)
        if self._bf16_packed is not None:
            return self.ops.linear(x, self._bf16_packed, self.out_features, self._bias_f32)
        if self._int8 is not None:
            out = torch.ops.aten._weight_int8pack_mm(x, *self._int8)
            return out if self.bias is None else out + self.bias
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return nn.functional.linear(x, self.weight, self.bias)

    def _quantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        # Parts in different types (Q4_K_M's Q6_K v_proj) run one GEMM each into their columns.
        outs = [self.ops.quantized_linear(x, s.packed, s.qtype, s.rows, self.in_features, s.bias_f32)
                for s in self.segments]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def forward_split(self, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """forward(x).split(sizes, -1), but parts that each lie inside one GGML segment are views of that
        segment's own output: a fused projection in two types (Q4_K_M's Q6_K qkv beside Q4_K z, b, a) skips
        joining its outputs only to split them again."""
        if (len(self.segments) < 2 or sum(sizes) != self.out_features
                or (self.row_tile is not None and x.shape[0] > self.row_tile)):
            return list(self.forward(x).split(sizes, dim=-1))  # (split raises on sizes that do not add up)
        bounds, first = [], 0
        for size in sizes:
            seg = next((s for s in self.segments if s.start <= first and first + size <= s.start + s.rows), None)
            if seg is None:  # a part straddles two segments
                return list(self.forward(x).split(sizes, dim=-1))
            bounds.append((seg, first - seg.start, size))
            first += size
        outs = {id(s): self.ops.quantized_linear(x, s.packed, s.qtype, s.rows, self.in_features, s.bias_f32)
                for s in {id(s): s for s, _, _ in bounds}.values()}
        return [outs[id(seg)].narrow(-1, offset, size) for seg, offset, size in bounds]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (M, in) -> (M, out)
        tile = self.row_tile
        if tile is None or x.shape[0] <= tile:
            return self.matmul(x)
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        for start in range(0, x.shape[0], tile):
            out[start:start + tile] = self.matmul(x[start:start + tile])
        return out

    def dense_weight(self) -> torch.Tensor:
        """The weight as a dense (out, in) tensor, rebuilt from whatever is kept (reference paths, tests; slow)."""
        if self.weight is not None:
            return self.weight.data
        if self.segments:
            return torch.cat([self.ops.dequantize_rows(s.packed, s.qtype, s.rows, self.in_features,
                                                       torch.arange(s.rows)) for s in self.segments])
        if self._int8 is not None:
            q, scale = self._int8
            return (q.float() * scale.float()[:, None]).to(scale.dtype)
        # The packed GEMM of the identity, no bias: each output is one exact product (w * 1), W^T bit for bit.
        eye = torch.eye(self.in_features, dtype=self.dtype)
        if self._bf16_packed is not None:
            return self.ops.linear(eye, self._bf16_packed, self.out_features, None).T.contiguous()
        return torch.ops.mkldnn._linear_pointwise(eye, self._packed, None, "none", [], "").T.contiguous()

    def gather_rows(self, row_ids: torch.Tensor) -> torch.Tensor | None:
        """Rows of W (output features) read from our bf16 GEMM's packed weight, or None where it is not packed so.

        Every packed layout is (panels, k pairs, columns per panel, 2) with W's bits in place, so a row is
        one panel's column: exact, and a tied embedding needs no copy of its own.
        """
        packed = self._bf16_packed
        if packed is None:
            return None
        cols = packed.shape[2]
        rows = packed[row_ids // cols, :, row_ids % cols, :]  # (R, k pairs, 2)
        return rows.reshape(row_ids.shape[0], -1)[:, :self.in_features]

    def stored_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(format, tensor) for every tensor this linear keeps: what its weight costs in memory."""
        kept = [(s.type_name, s.packed) for s in self.segments]
        if self._int8 is not None:
            kept += [("INT8", t) for t in self._int8]
        for tensor in (self.weight, self._bf16_packed, self._packed):
            if tensor is not None:
                kept.append((dtype_name(tensor.dtype), tensor))
        if self.bias is not None:
            kept.append((dtype_name(self.bias.dtype), self.bias))
        return kept


class QuantizedEmbedding(nn.Module):
    """Token embeddings kept as GGML blocks: each step dequantizes only the rows it looks up.

    The packed tensor is the segment of a tied lm_head too (one copy for both).
    """

    def __init__(self, segment: QuantSegment, embedding_dim: int, ops: KernelBackend) -> None:
        super().__init__()
        self.segment, self.embedding_dim, self.ops = segment, embedding_dim, ops
        self.num_embeddings = segment.rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, hidden) bf16
        s = self.segment
        return self.ops.dequantize_rows(s.packed, s.qtype, s.rows, self.embedding_dim, input_ids.long())

    def stored_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(self.segment.type_name, self.segment.packed)]


class TiedPackedEmbedding(nn.Module):
    """Token embeddings read from a tied lm_head's packed bf16 weight (one copy for both)."""

    def __init__(self, head: RowInvariantLinear) -> None:
        super().__init__()
        self.head = [head]  # a list: not a submodule, so the head's weights are not counted twice
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, hidden)
        return self.head[0].gather_rows(input_ids.long())

    def stored_weights(self) -> list[tuple[str, torch.Tensor]]:
        return []


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int8: "INT8"}.get(
        dtype, str(dtype).removeprefix("torch."))


def calibrate_row_tile(linear: RowInvariantLinear, max_tile: int = 64) -> int:
    """Largest tile T (power of two, <= max_tile) for which every M <= T gives bitwise the rows of M=1."""
    dtype = linear.dtype or linear.weight.dtype
    device = linear.weight.device if linear.weight is not None else torch.device("cpu")
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(max_tile, linear.in_features, generator=gen).to(device, dtype)
    single = torch.cat([linear.matmul(x[i:i + 1]) for i in range(max_tile)])
    tile = max_tile
    while tile > 1:
        sizes = {tile, tile - 1, tile // 2 + 1, 3, 2}
        if all(torch.equal(linear.matmul(x[:m]), single[:m]) for m in sizes if m >= 1):
            return tile
        tile //= 2
    return 1


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by absolute position (HF 'rotate_half' convention)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        inv_freq, attention_factor = _scale_inv_freq(inv_freq, scaling, max_positions, theta)
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)  # (P, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (P, D)
        sin = emb.sin() * attention_factor
        half = head_dim // 2
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        # rotate_half(x) * sin == roll(x, D/2) * [-sin_lo, sin_hi]: one roll instead of slice/neg/cat.
        self.register_buffer("signed_sin", torch.cat([-sin[:, :half], sin[:, half:]], dim=-1), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, 1, D) cos and signed sin for these positions, computed once per forward."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.signed_sin[positions].to(dtype).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any] | None,
                    max_positions: int, theta: float) -> tuple[torch.Tensor, float]:
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if kind == "proportional":
        # Gemma 4's global layers: the first partial_rotary_factor of the pairs turn (exponents over the whole
        # head), the rest get frequency 0 (cos 1, sin 0: left as they are)
        turning = int(float(scaling.get("partial_rotary_factor", 1.0)) * 2 * inv_freq.numel() // 2)
        inv_freq = torch.cat([inv_freq[:turning], torch.zeros(inv_freq.numel() - turning)])
        return inv_freq / float(scaling.get("factor", 1.0)), 1.0
    if kind in ("longrope", "su"):
        return _longrope(inv_freq, scaling, max_positions)
    if kind == "yarn":
        return _yarn(inv_freq, scaling, max_positions, theta)
    raise ModelConfigError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, longrope, yarn, proportional)")


def _yarn(inv_freq: torch.Tensor, scaling: dict[str, Any], max_positions: int,
          theta: float) -> tuple[torch.Tensor, float]:
    """YaRN (OLMo 3, Ministral 3): high frequencies kept, low ones divided by `factor`, a linear ramp between
    the dims that turn beta_fast and beta_slow times over the original context; cos/sin scaled by the
    attention factor. transformers' _compute_yarn_parameters, op for op."""
    dim = 2 * inv_freq.numel()
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_positions / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention_factor)


def _longrope(inv_freq: torch.Tensor, scaling: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    """Phi-3's su/longrope: per-frequency divisors, the long ones when the context outgrows the original.

    NOTE: transformers switches factors per forward (by its longest sequence), so cached keys and new
    queries can disagree; here the choice is fixed by the context the model is built for, as llama.cpp
    does (by n_ctx), which keeps every row independent of its batch-mates.
    """
    original = int(scaling["original_max_position_embeddings"])
    factors = scaling["long_factor"] if max_positions > original else scaling["short_factor"]
    ext = torch.tensor(factors, dtype=torch.float32)
    if ext.numel() != inv_freq.numel():
        raise ModelConfigError(f"longrope has {ext.numel()} factors for {inv_freq.numel()} rotary frequencies")
    factor = float(scaling.get("factor") or max_positions / original)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return inv_freq / ext, float(attention_factor)
