"""The compute backend of one model: which kernels run, and what that guarantees.

Resolved once, at model build (`resolve_backend`), and passed to every layer, so no call site
looks anything up and every call of a process takes the same arithmetic path. Each op has a
torch fallback, used where a kernel is missing (no compiler, off CPU); the backend then says
plainly that batch invariance, and with it speculation, is off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import lru_cache
from types import ModuleType
from typing import Any

import torch
from torch import nn

from conveyor.kernels.attention import (AttentionMetadata, reference_dense_attention, reference_paged_attention,
                                        write_kv)
from conveyor.kernels.build import KERNELS, load_kernels
from conveyor.kernels.kv_quant import is_quantized
from conveyor.kernels.recurrent import (StateMetadata, reference_gated_delta_rule, reference_gated_rms_norm,
                                        reference_short_conv, reference_silu_gate, reference_ssm_scan)

logger = logging.getLogger(__name__)


class KernelsRequiredError(RuntimeError):
    """CONVEYOR_REQUIRE_KERNELS=1 and a kernel did not build (CI: never fall back silently)."""


@dataclass(frozen=True)
class KernelSettings:
    """The kernel knobs of EngineConfig (CONVEYOR_KERNEL_ARCH, _REQUIRE_KERNELS, _DISABLE_KERNEL)."""

    arch: str = "native"
    require: bool = False
    disable: bool = False


@dataclass(frozen=True)
class KernelBackend:
    name: str  # amx | avx512_bf16 | avx512 | avx2 | neon | generic | torch | cuda | mps
    device: str  # cpu | cuda | mps
    arch: str | None  # -march the CPU kernels were built for; None off CPU or without kernels
    batch_invariant: bool  # greedy rows bitwise independent of batch-mates, chunking, prefix hits
    gemm: ModuleType | None = None
    attention: ModuleType | None = None
    fused: ModuleType | None = None
    qgemm: ModuleType | None = None  # GGML block-quantized linears (csrc/qgemm.cpp)
    recurrent: ModuleType | None = None  # hybrid models' recurrent mixers (csrc/recurrent.cpp)
    errors: dict[str, str] = field(default_factory=dict)  # kernel -> why it is missing (first compiler error)

    @property
    def speculation(self) -> bool:
        """Drafts are verified as a prefill chunk: their rows must be bitwise the decoded rows."""
        return self.batch_invariant

    def describe(self) -> dict[str, Any]:
        """The /props, /health and `conveyor env` view."""
        return {"backend": self.name, "arch": self.arch, "batch_invariant": self.batch_invariant,
                "speculation": self.speculation, "device": self.device,
                "kernels": {k: (getattr(self, _ATTR[k]).isa() if getattr(self, _ATTR[k]) is not None else None)
                            for k in KERNELS},
                "errors": dict(self.errors)}

    def summary(self) -> str:
        text = (f"kernels: backend={self.name} arch={self.arch} batch_invariant={self.batch_invariant} "
                f"speculation={self.speculation}")
        if self.errors:
            text += " (" + "; ".join(f"{k}: {e}" for k, e in self.errors.items()) + ")"
        return text

    # --- the ops, each with its torch fallback ---------------------------------------------

    def pack_linear(self, weight: torch.Tensor) -> torch.Tensor | None:
        """Our GEMM's packed weight, or None where it does not run (the caller keeps oneDNN/torch)."""
        if self.gemm is None or weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
            return None
        return self.gemm.pack(weight)

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias_f32: torch.Tensor | None) -> torch.Tensor:
        return self.gemm.linear(x, packed, out_features, bias_f32)

    # --- quantized weights (GGML blocks; see quant_ref.py for the types and the reference math) ---

    def runs_quantized(self, qtype: int) -> bool:
        """Whether a weight of this GGML type can stay quantized here (else the loader dequantizes it)."""
        return self.qgemm is not None and self.device == "cpu" and self.qgemm.supports(int(qtype))

    def pack_quantized(self, raw: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
        """raw GGML rows (N, row_bytes) uint8 -> the kernel's layout of the same bits (opaque)."""
        return self.qgemm.pack(raw, int(qtype), in_features)

    def quantized_linear(self, x: torch.Tensor, packed: torch.Tensor, qtype: int, out_features: int,
                         in_features: int, bias_f32: torch.Tensor | None) -> torch.Tensor:
        """x (M, K) bf16 -> (M, N) bf16; each output one fixed reduction whatever M (batch-invariant)."""
        return self.qgemm.linear(x, packed, int(qtype), out_features, in_features, bias_f32)

    def quantized_linear_grouped(self, x: torch.Tensor, packed: list[torch.Tensor], qtype: int, out_features: int,
                                 in_features: int, offsets: list[int],
                                 bias_f32: list[torch.Tensor | None]) -> torch.Tensor:
        """A MoE layer's experts in one call: x (T, K) bf16, rows [offsets[e], offsets[e + 1]) through expert e's
        packed weight (+ bias_f32[e]; [] for none) -> (T, N) bf16, each row's bits as quantized_linear on its
        expert's rows alone."""
        return self.qgemm.linear_grouped(x, packed, int(qtype), out_features, in_features, offsets, bias_f32)

    def dequantize_rows(self, packed: torch.Tensor, qtype: int, out_features: int, in_features: int,
                        row_ids: torch.Tensor) -> torch.Tensor:
        """Rows `row_ids` of a packed weight as bf16 (R, K): embedding lookups, reference paths."""
        return self.qgemm.dequantize_rows(packed, int(qtype), out_features, in_features, row_ids)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.fused is not None and x.device.type == "cpu":
            return self.fused.rms_norm(x, weight, eps)
        # Same op order as transformers (fp32 statistics, cast back before the weight).
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused is not None and x.device.type == "cpu":
            summed, normed = self.fused.add_rms_norm(x, delta, weight, eps)
            return summed, normed  # the binding hands back a list
        summed = x + delta
        return summed, self.rms_norm(summed, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for a fused (T, 2I) gate|up projection, rounding where torch's two ops would."""
        if self.fused is not None and gate_up.device.type == "cpu":
            return self.fused.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up for a fused (T, 2I) gate|up (Gemma's GeGLU), rounding where torch's two ops would."""
        if self.fused is not None and gate_up.device.type == "cpu":
            return self.fused.gelu_tanh_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.gelu(gate, approximate="tanh") * up

    def gelu_tanh_(self, x: torch.Tensor) -> torch.Tensor:
        """The tanh GELU in place (SigLIP's MLP; no output allocation, 35 MB per layer at 896 px), x contiguous:
        elementwise in fp32 and rounded once to x's dtype (gelu_tanh_mul's gate formula), an element's bits never
        depending on where it sits."""
        if self.fused is not None and x.device.type == "cpu":
            return self.fused.gelu_tanh_(x)
        return torch.ops.aten.gelu_(x, approximate="tanh")

    def gelu_erf(self, x: torch.Tensor) -> torch.Tensor:
        """The exact (erf) GELU, x * Phi(x), elementwise in fp32 and rounded once to x's dtype; an element's bits
        never depend on where it sits or how many rows share the call."""
        if self.fused is not None and x.device.type == "cpu":
            return self.fused.gelu_erf(x)
        return _gelu_erf_reference(x)

    def gelu_erf_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_erf(gate) * up for a fused (T, 2I) gate|up (ModernBERT's GeGLU), rounding where torch's ops would."""
        if self.fused is not None and gate_up.device.type == "cpu":
            return self.fused.gelu_erf_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return _gelu_erf_reference(gate) * up

    def xielu(self, x: torch.Tensor, alpha_p: float, alpha_n: float, beta: float, eps: float) -> torch.Tensor:
        """Apertus' xIELU (alpha_p, alpha_n after their softplus), elementwise, rounding where torch's ops would."""
        if self.fused is not None and x.device.type == "cpu":
            return self.fused.xielu(x, alpha_p, alpha_n, beta, eps)
        # NOTE: torch splits its range into a vector body and a scalar tail, so off our kernels rows may differ
        # in the last bit by batch position (transformers' expression, op for op).
        ap, an, b, e = (torch.tensor(v, dtype=x.dtype, device=x.device) for v in (alpha_p, alpha_n, beta, eps))
        return torch.where(x > 0, ap * x * x + b * x, (torch.expm1(torch.min(x, e)) - x) * an + b * x)

    @staticmethod
    def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
        """cap * tanh(x / cap), transformers' order (Gemma 2's final logits); elementwise."""
        return torch.tanh(x / cap) * cap

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and logits.device.type == "cpu":
            return self.fused.argmax_rows(logits)
        return logits.argmax(dim=-1)

    @property
    def fuses_rope(self) -> bool:
        return self.fused is not None and self.device == "cpu"

    def rope_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                      key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_heads: int) -> torch.Tensor:
        """Rotary on q|k, k/v scattered into their slots, rotated q returned as (T, H, D) (needs fuses_rope)."""
        return self.fused.rope_write_kv(qkv, cos, signed_sin, key_cache, value_cache, slot_mapping, num_heads)

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """K/V (T, KVH, D) into their slots; a Q8_0 cache (uint8) gets each row quantized as it is written."""
        if self.fused is not None and key.device.type == "cpu" and (is_quantized(key_cache) or is_quantized(value_cache)):
            self.fused.write_kv(key, value, key_cache, value_cache, slot_mapping)
            return
        write_kv(key_cache, value_cache, key, value, slot_mapping)

    def paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
        """query (T, H, D) -> (T, H, D); every row attends its own sequence's keys [0, pos]
        (or only the last `window` of them, for sliding-window attention; a negative window: only its own chunk
        of -window positions, Llama 4's chunked attention); scores soft-capped when softcap > 0;
        `sinks` (H,) fp32 (GPT-OSS): one more logit per head in each softmax's denominator, with no value.
        Either cache may hold Q8_0 rows (uint8, kv_quant.py): the kernel reads the int8 blocks in place."""
        if self.attention is not None and query.device.type == "cpu":
            return self.attention.paged_attention(query, key_cache, value_cache, meta.block_tables, meta.token_seq,
                                                  meta.token_pos, scale, window, softcap, sinks, meta.key_end)
        return reference_paged_attention(query, key_cache, value_cache, meta, scale, window, softcap=softcap,
                                         sinks=sinks)

    def dense_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
                        scale: float) -> torch.Tensor:
        """Full (unmasked) attention over one sequence, a vision tower's patches: q, k, v (P, H * D), each row
        contiguous (column slices of a fused qkv are fine) -> (P, H * D). Our kernel where it runs AMX tiles (bf16,
        CPU: ~5x torch's at SigLIP-so400m's 4096 patches); elsewhere torch in blocks of queries, which beat the
        kernel's fp32 path on the one machine measured. Either way one image's output is the same bits every call."""
        if (self.attention is not None and q.device.type == "cpu" and q.dtype == torch.bfloat16
                and self.attention.dense_attention_path(q.shape[1] // num_heads) == "amx"):
            return self.attention.dense_attention(q, k, v, num_heads, scale)
        return reference_dense_attention(q, k, v, num_heads, scale)

    # --- recurrent mixers (hybrid models): state slots walked token by token (recurrent.py) ---

    def _runs_recurrent(self, x: torch.Tensor) -> bool:
        return self.recurrent is not None and x.device.type == "cpu"

    def short_conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                   meta: StateMetadata, apply_silu: bool) -> torch.Tensor:
        """Causal depthwise conv over each sequence's rows: x (T, C), weight (C, K) fp32, state (slots, C, K-1) fp32.
        x's rows may lie apart (a column slice of a projection): the kernel reads them in place."""
        if self._runs_recurrent(x):
            return self.recurrent.short_conv(x, weight, bias, state, *meta.args(), apply_silu)
        return reference_short_conv(x, weight, bias, state, meta, apply_silu)

    def gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                         meta: StateMetadata) -> torch.Tensor:
        """Gated DeltaNet: q, k (T, Hk, dk), v (T, Hv, dv), raw a, b (T, Hv) -> (T, Hv, dv); inputs may be column
        slices of a wider projection (rows apart, each row contiguous), read in place."""
        if self._runs_recurrent(q):
            return self.recurrent.gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, *meta.args())
        return reference_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, meta)

    def ssm_scan(self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, A_log: torch.Tensor,
                 dt_bias: torch.Tensor, D: torch.Tensor, state: torch.Tensor, meta: StateMetadata,
                 dt_min: float = 0.0, dt_max: float = float("inf")) -> torch.Tensor:
        """Mamba2: x (T, H, P), raw dt (T, H), B, C (T, G, N) -> fp32 (T, H, P) (its gated norm rounds it)."""
        if self._runs_recurrent(x):
            return self.recurrent.ssm_scan(x, dt, B, C, A_log, dt_bias, D, state, *meta.args(), dt_min, dt_max)
        return reference_ssm_scan(x, dt, B, C, A_log, dt_bias, D, state, meta, dt_min, dt_max)

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group: int,
                       norm_before_gate: bool) -> torch.Tensor:
        """x (R, n) or (T, heads, n) in gate's dtype or fp32 -> gate's dtype, the same shape; RMSNorm over groups of
        `group` columns of each row of n, with a SiLU gate. Token rows may lie apart (a slice of a projection)."""
        if self._runs_recurrent(x):
            return self.recurrent.gated_rms_norm(x, gate, weight, eps, group, norm_before_gate)
        n = x.shape[-1]
        return reference_gated_rms_norm(x.reshape(-1, n), gate.reshape(-1, n), weight, eps, group,
                                        norm_before_gate).view(gate.shape)

    def silu_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x (gate's dtype or fp32) * silu(gate) -> gate's dtype, rounded where torch's two ops would."""
        if self._runs_recurrent(x):
            return self.recurrent.silu_gate(x, gate)
        return reference_silu_gate(x, gate)

    def sigmoid_mul(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x * sigmoid(gate), rounded where torch's two ops would (elementwise; the same function on every lane)."""
        if self._runs_recurrent(x):
            return self.recurrent.sigmoid_mul(x, gate)
        return x * torch.sigmoid(gate)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        """sigmoid(x) rounded to x's dtype, a scalar call per element (MoE router scores and shared-expert gates)."""
        if self._runs_recurrent(x):
            return self.recurrent.sigmoid(x)
        return torch.sigmoid(x)


def _gelu_erf_reference(x: torch.Tensor) -> torch.Tensor:
    """x * Phi(x) in fp32, rounded once.

    NOTE: not torch's gelu: its vector body and scalar tail compute erf differently (1452 of 4096 fp32 values
    differ) and it splits its range at element counts, so a row's bits would depend on the batch. torch's ndtr
    runs one scalar formula (std::erf) for every element: a row is the same alone or in any batch."""
    x32 = x.float()
    return torch.special.ndtr(x32).mul_(x32).to(x.dtype)


_ATTR = {"gemm": "gemm", "attention": "attention", "fused_ops": "fused", "qgemm": "qgemm", "recurrent": "recurrent"}


def resolve_backend(device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                    settings: KernelSettings = KernelSettings(), batch_invariant: bool = True) -> KernelBackend:
    """The backend for a model on `device` in `dtype`: our CPU kernels where they build, else torch.

    Batch invariance on CPU needs the attention kernel (fixed per-row order, chunk-invariant)
    and linears that are row-invariant: our GEMM in bf16, oneDNN in calibrated row tiles otherwise.
    """
    device = torch.device(device)
    if device.type != "cpu":
        # NOTE: torch's CUDA/MPS kernels pick algorithms by shape; rows are not bitwise batch-invariant.
        return KernelBackend(name=device.type, device=device.type, arch=None, batch_invariant=False)
    if settings.disable:
        return _torch_cpu_backend({k: "disabled (CONVEYOR_DISABLE_KERNEL=1)" for k in KERNELS})
    omp_spin_warning()
    builds = load_kernels(settings.arch)
    errors = {k: b.error for k, b in builds.items() if b.module is None}
    if errors and settings.require:
        raise KernelsRequiredError("C++ kernels required (CONVEYOR_REQUIRE_KERNELS=1) but unavailable: "
                                   + "; ".join(f"{k}: {e}" for k, e in errors.items()))
    gemm, attention, fused, qgemm, recurrent = (builds[k].module for k in KERNELS)
    if gemm is None and attention is None and fused is None:
        return _torch_cpu_backend(errors)
    gemm_level = gemm.backend() if gemm is not None else None
    name = gemm_level or (attention or fused).isa()
    # Linears without our GEMM (no gemm module, or not bf16) run oneDNN in row tiles calibrated at load.
    invariant = batch_invariant and attention is not None
    return KernelBackend(name=name, device="cpu", arch=settings.arch, batch_invariant=invariant, gemm=gemm,
                         attention=attention, fused=fused, qgemm=qgemm, recurrent=recurrent, errors=errors)


@lru_cache(maxsize=1)
def omp_spin_warning() -> bool:
    """Warn once where torch loaded OpenMP before conveyor could ask for sleeping waiters (conveyor/__init__.py)."""
    import conveyor
    if not conveyor.OMP_WAIT_POLICY_TOO_LATE:
        return False
    logger.warning("torch was imported before conveyor with OMP_WAIT_POLICY unset: torch's OpenMP threads spin "
                   "after each parallel op and take the cores conveyor's kernels need next (speculative decoding "
                   "~10% slower measured). Import conveyor before torch, or set OMP_WAIT_POLICY=PASSIVE.")
    return True


def _torch_cpu_backend(errors: dict[str, str]) -> KernelBackend:
    return KernelBackend(name="torch", device="cpu", arch=None, batch_invariant=False, errors=errors)


@lru_cache(maxsize=4)
def cpu_backend(settings: KernelSettings = KernelSettings()) -> KernelBackend:
    """The bf16 CPU backend for `settings`, resolved once per value (tests, tools). Kernels take their
    settings as arguments: the caller reads the environment (config.kernel_settings_from_env())."""
    return resolve_backend("cpu", torch.bfloat16, settings)
