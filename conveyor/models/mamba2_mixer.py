"""The Mamba2 token mixer (Mamba2, Granite 4.0-H, Nemotron-H, Falcon-H1), as transformers' torch path runs it.

    x --in_proj--> z | xBC | dt          one GEMM
    xBC --SiLU short conv--> x | B | C   the conv window is state 0
    y = selective scan(x, dt, B, C)      per head, state 1 (H, P, N); y + D * x, left in fp32
    out_proj(gated_rms_norm(y, z))       or y * silu(z) (Falcon-H1 without its norm)
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.kernels import KernelBackend
from conveyor.models.cache_specs import CacheSpec, StateSpec
from conveyor.models.config import ModelConfig
from conveyor.models.hybrid_base import Getter, LayerContext, NormGetter, conv_weight, fp32_param, scaled
from conveyor.models.layers import RowInvariantLinear
from conveyor.models.weights import WeightLoader


class Mamba2Mixer(nn.Module):
    cache_index: int = -1

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.ops = ops
        self.heads, self.head_dim = config.mamba_num_heads, config.mamba_head_dim
        self.groups, self.state_size = config.mamba_num_groups, config.mamba_state_size
        self.inner = config.mamba_inner_size
        self.conv_size = self.inner + 2 * self.groups * self.state_size  # x | B | C
        self.width = config.conv_kernel_size
        bias = config.mamba_proj_bias
        self.in_proj = RowInvariantLinear(config.hidden_size, self.inner + self.conv_size + self.heads, bias, ops)
        self.out_proj = RowInvariantLinear(self.inner, config.hidden_size, bias, ops)
        self.norm_weight = (nn.Parameter(torch.empty(self.inner, device="meta"), requires_grad=False)
                            if config.mamba_rms_norm else None)
        self.norm_before_gate, self.eps = config.mamba_norm_before_gate, config.rms_norm_eps
        self.dt_limits = (config.mamba_dt_min, config.mamba_dt_max)
        self.has_conv_bias = config.conv_bias
        self.conv_weight: torch.Tensor | None = None  # (C, K) fp32
        self.conv_bias: torch.Tensor | None = None
        self.A_log: torch.Tensor | None = None  # (H,) fp32 each, of the model-dtype parameters
        self.dt_bias: torch.Tensor | None = None
        self.D: torch.Tensor | None = None
        self.in_multiplier, self.in_scale = config.mamba_in_multiplier, self._in_scale(config)
        self.out_scale = config.mamba_out_multiplier

    def _in_scale(self, config: ModelConfig) -> torch.Tensor | None:
        """Falcon-H1's multipliers on in_proj's z, x, B, C and dt rows (None: all 1)."""
        if not config.mamba_section_multipliers:
            return None
        sizes = (self.inner, self.inner, self.groups * self.state_size, self.groups * self.state_size, self.heads)
        return torch.cat([torch.full((n,), m) for n, m in zip(sizes, config.mamba_section_multipliers)])

    def cache_spec(self) -> CacheSpec:
        return StateSpec(((self.conv_size, self.width - 1), (self.heads, self.head_dim, self.state_size)))

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        T, G, N = x.shape[0], self.groups, self.state_size
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_size, self.heads], dim=-1)
        conv_state, ssm_state = ctx.caches[self.cache_index]
        xbc = self.ops.short_conv(xbc.contiguous(), self.conv_weight, self.conv_bias, conv_state, ctx.meta.state,
                                  apply_silu=True)  # (T, C)
        xs, B, C = xbc.split([self.inner, G * N, G * N], dim=-1)
        y = self.ops.ssm_scan(xs.reshape(T, self.heads, self.head_dim), dt.contiguous(), B.reshape(T, G, N),
                              C.reshape(T, G, N), self.A_log, self.dt_bias, self.D, ssm_state, ctx.meta.state,
                              *self.dt_limits)  # (T, H, P) fp32
        y, z = y.reshape(T, self.inner), z.contiguous()
        if self.norm_weight is None:
            return self.out_proj(self.ops.silu_gate(y, z))
        # transformers' group size: the width over n_groups (Mamba2's MambaRMSNormGated, Falcon-H1's n_groups)
        return self.out_proj(self.ops.gated_rms_norm(y, z, self.norm_weight, self.eps, self.inner // self.groups,
                                                     self.norm_before_gate))

    def load(self, get: Getter, prefix: str, names: dict[str, str], loader: WeightLoader, norm: NormGetter) -> None:
        # Falcon-H1: (W (m_in * h) + b) * m_row = (m_in * m_row * W) h + m_row * b
        rows = 1.0 if self.in_scale is None else self.in_scale
        in_name, out_name = f"{prefix}{names['in']}", f"{prefix}{names['out']}"
        bias = self.in_proj.bias is not None
        loader.linear(self.in_proj, [scaled(get(f"{in_name}.weight"), rows * self.in_multiplier)],
                      [scaled(get(f"{in_name}.bias"), rows)] if bias else None)
        loader.linear(self.out_proj, [scaled(get(f"{out_name}.weight"), self.out_scale)],
                      [scaled(get(f"{out_name}.bias"), self.out_scale)] if bias else None)
        conv = f"{prefix}{names['conv']}"
        self.conv_weight = conv_weight(loader, get(f"{conv}.weight"))
        if self.has_conv_bias:
            self.conv_bias = fp32_param(loader, get(f"{conv}.bias"))
        self.A_log, self.dt_bias, self.D = (fp32_param(loader, get(f"{prefix}{p}")) for p in ("A_log", "dt_bias", "D"))
        if self.norm_weight is not None:
            self.norm_weight = loader.param(get(f"{prefix}{names['norm']}.weight"))  # plain w, as transformers'
