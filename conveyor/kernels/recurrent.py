"""Recurrent mixers' metadata and torch reference paths (csrc/recurrent.cpp is the fast, exact form).

Each sequence of a forward owns one state slot. Its rows are walked token by token, so a prefill
chunk of any size gives the state and outputs of decoding one token at a time; the C++ kernels do
the same walk with every nonlinearity as a scalar call (batch-invariant). These references run
where the kernel is missing (no compiler, off CPU) and in the kernel tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class StateMetadata:
    """Per-forward sequence layout for the recurrent layers (built once per step by the runner)."""

    starts: torch.Tensor  # (S + 1,) int64: first row of each sequence, then the row count
    slots: torch.Tensor  # (S,) int64: state slot of each sequence
    reset: torch.Tensor  # (S,) bool: the chunk starts at position 0, from a zero state
    # Snapshots (CSR per sequence): after snap_counts[i] of its chunk's tokens, copy the state to snap_slots[i].
    snap_starts: torch.Tensor  # (S + 1,) int64
    snap_counts: torch.Tensor  # (M,) int64
    snap_slots: torch.Tensor  # (M,) int64

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.starts, self.slots, self.reset, self.snap_starts, self.snap_counts, self.snap_slots

    @classmethod
    def build(cls, counts: list[int], slots: list[int], reset: list[bool],
              snapshots: list[list[tuple[int, int]]] | None = None, device: torch.device | None = None
              ) -> "StateMetadata":
        """counts: rows of each sequence; snapshots: per sequence, (tokens processed, slot) pairs in order."""
        snapshots = snapshots or [[] for _ in counts]
        starts, snap_starts = [0], [0]
        for n, snaps in zip(counts, snapshots):
            starts.append(starts[-1] + n)
            snap_starts.append(snap_starts[-1] + len(snaps))
        flat = [pair for snaps in snapshots for pair in snaps]

        def t(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(t(starts), t(slots), t(reset, torch.bool), t(snap_starts), t([c for c, _ in flat]),
                   t([s for _, s in flat]))

    def walk(self):
        """(sequence, first row, row count, slot, reset, [(count, slot)]) per sequence, on the host."""
        starts, slots, reset = self.starts.tolist(), self.slots.tolist(), self.reset.tolist()
        snap_starts, counts, snap_slots = self.snap_starts.tolist(), self.snap_counts.tolist(), self.snap_slots.tolist()
        for s in range(len(slots)):
            snaps = list(zip(counts[snap_starts[s]:snap_starts[s + 1]], snap_slots[snap_starts[s]:snap_starts[s + 1]]))
            yield s, starts[s], starts[s + 1] - starts[s], slots[s], reset[s], snaps


def reference_short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                         meta: StateMetadata, apply_silu: bool) -> torch.Tensor:
    """x (T, C) -> (T, C); state (slots, C, K-1) fp32 holds the last K-1 inputs, oldest first."""
    out = torch.empty_like(x)
    width = weight.shape[1] - 1
    for _, first, n, slot, reset, snaps in meta.walk():
        window = torch.zeros(x.shape[1], width) if reset else state[slot].clone()
        full = torch.cat([window, x[first:first + n].float().T], dim=1)  # (C, K-1 + n)
        for t in range(n):
            y = (full[:, t:t + width + 1] * weight).sum(-1)
            if bias is not None:
                y = y + bias
            y = y.to(x.dtype)
            out[first + t] = (nn.functional.silu(y.float()) if apply_silu else y).to(x.dtype)
            for count, dst in snaps:
                if count == t + 1:
                    state[dst] = full[:, t + 1:t + 1 + width]
        state[slot] = full[:, n:n + width]
    return out


def reference_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                               A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                               meta: StateMetadata) -> torch.Tensor:
    """q, k (T, Hk, dk), v (T, Hv, dv), a, b (T, Hv) -> (T, Hv, dv); state (slots, Hv, dk, dv) fp32."""
    group = v.shape[1] // q.shape[1]
    out = torch.empty_like(v)
    qf = q.float().repeat_interleave(group, dim=1)
    kf = k.float().repeat_interleave(group, dim=1)
    qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + 1e-6) / q.shape[-1] ** 0.5
    kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    decay = torch.exp(-A_log.exp() * nn.functional.softplus(a.float() + dt_bias))  # (T, Hv)
    beta = torch.sigmoid(b).float()
    for _, first, n, slot, reset, snaps in meta.walk():
        S = torch.zeros_like(state[slot]) if reset else state[slot].clone()  # (Hv, dk, dv)
        for t in range(first, first + n):
            S = S * decay[t][:, None, None]
            kv_mem = (S * kf[t][:, :, None]).sum(1)  # (Hv, dv)
            delta = (v[t].float() - kv_mem) * beta[t][:, None]
            S = S + kf[t][:, :, None] * delta[:, None, :]
            out[t] = (S * qf[t][:, :, None]).sum(1).to(v.dtype)
            for count, dst in snaps:
                if count == t - first + 1:
                    state[dst] = S
        state[slot] = S
    return out


def reference_ssm_scan(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, A_log: torch.Tensor,
                       dt_bias: torch.Tensor, D: torch.Tensor, state: torch.Tensor, meta: StateMetadata,
                       dt_min: float, dt_max: float) -> torch.Tensor:
    """x (T, H, P), dt (T, H), B, C (T, G, N) -> fp32 (T, H, P); state (slots, H, P, N) fp32.

    As transformers' chunked scan: dt's steps in the model dtype, the rest in fp32, y left in fp32."""
    group = x.shape[1] // B.shape[1]
    out = torch.empty(x.shape, dtype=torch.float32)
    step = (dt.float() + dt_bias).to(dt.dtype)
    step = nn.functional.softplus(step.float()).to(dt.dtype).clamp(dt_min, dt_max).float()  # (T, H)
    dA = torch.exp(step * -A_log.exp())
    Bf = B.float().repeat_interleave(group, dim=1)  # (T, H, N)
    Cf = C.float().repeat_interleave(group, dim=1)
    for _, first, n, slot, reset, snaps in meta.walk():
        S = torch.zeros_like(state[slot]) if reset else state[slot].clone()  # (H, P, N)
        for t in range(first, first + n):
            xdt = x[t].float() * step[t][:, None]  # (H, P)
            S = S * dA[t][:, None, None] + xdt[:, :, None] * Bf[t][:, None, :]
            out[t] = (S * Cf[t][:, None, :]).sum(-1) + D[:, None] * x[t].float()
            for count, dst in snaps:
                if count == t - first + 1:
                    state[dst] = S
        state[slot] = S
    return out


def reference_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group: int,
                             norm_before_gate: bool) -> torch.Tensor:
    """x (model dtype or fp32), gate (R, n) -> gate's dtype: Qwen3.5's norm-then-gate, or Mamba2's
    gate-then-norm over groups of `group` columns; steps round to x's dtype, the output to gate's."""
    dtype = x.dtype
    h = x.float()
    if not norm_before_gate:
        h = h * nn.functional.silu(gate.float())
    shaped = h.view(h.shape[0], -1, group)
    normed = (shaped * torch.rsqrt(shaped.pow(2).mean(-1, keepdim=True) + eps)).view_as(h)
    out = (weight * normed.to(dtype)).to(dtype)
    if norm_before_gate:
        out = out * nn.functional.silu(gate.float())
    return out.to(gate.dtype)


def reference_silu_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x (model dtype or fp32) * silu(gate) -> gate's dtype, rounded as torch's two ops round."""
    return (x * nn.functional.silu(gate)).to(gate.dtype)
