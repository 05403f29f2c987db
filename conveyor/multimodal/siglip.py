"""The SigLIP encoder layer Gemma 3, Idefics3 and LFM2-VL's towers share (pre-LN attention + GELU-tanh MLP, q / k /
v as one GEMM), as transformers' SiglipEncoderLayer computes it, and its parameters' names in a transformers
checkpoint. Attention and GELU run through the engine's KernelBackend where one is given."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from conveyor.kernels import KernelBackend
from conveyor.kernels.attention import reference_dense_attention


@dataclass
class SiglipBuffers:
    """Activations one encode's layers share: fresh ones (9-35 MB each at 896 px) cost page faults every layer
    (~9 ms per 35 MB here)."""

    qkv: torch.Tensor  # (P, 3 hidden)
    mlp: torch.Tensor  # (P, intermediate)
    proj: torch.Tensor  # (P, hidden): out_proj's and fc2's outputs, added into the residual in place

    @classmethod
    def like(cls, x: torch.Tensor, intermediate: int) -> SiglipBuffers:
        rows, hidden = x.shape
        return cls(x.new_empty(rows, 3 * hidden), x.new_empty(rows, intermediate), x.new_empty(rows, hidden))


class SiglipLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int, eps: float,
                 ops: KernelBackend | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.ops = ops  # our kernels (attention, GELU); None: plain torch
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(hidden, hidden) for _ in range(4))
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self._qkv: tuple[torch.Tensor, torch.Tensor] | None = None  # (3 hidden, hidden) weight, bias: _fused_qkv()

    def forward(self, x: torch.Tensor, buffers: SiglipBuffers | None = None) -> torch.Tensor:
        """(P, hidden) -> (P, hidden). With `buffers` the outputs land there and x is updated in place."""
        hidden = x.shape[1]
        weight, bias = self._fused_qkv()
        h = self.layer_norm1(x)
        qkv = _linear(h, weight, bias, None if buffers is None else buffers.qkv)  # (P, 3 hidden)
        q, k, v = qkv.split(hidden, dim=1)
        attend = self.ops.dense_attention if self.ops is not None else reference_dense_attention
        attn = attend(q, k, v, self.heads, (hidden // self.heads) ** -0.5)
        x = _residual(x, _linear(attn, self.out_proj.weight, self.out_proj.bias, buffers and buffers.proj), buffers)
        h = _linear(self.layer_norm2(x), self.fc1.weight, self.fc1.bias, buffers and buffers.mlp)
        h = self.ops.gelu_tanh_(h) if self.ops is not None else torch.ops.aten.gelu_(h, approximate="tanh")
        return _residual(x, _linear(h, self.fc2.weight, self.fc2.bias, buffers and buffers.proj), buffers)

    def _fused_qkv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k and v's weights (biases) as row blocks of one matrix, for one GEMM: the three parameters become views
        of it (one copy kept); rebuilt when a parameter was replaced (a reload, a move to another device)."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        if self._qkv is None or any(p.weight.data_ptr() != self._qkv[0][i * p.weight.shape[0]:].data_ptr()
                                    for i, p in enumerate(parts)):
            with torch.inference_mode(False), torch.no_grad():  # plain tensors, as loaded: usable outside encode()
                weight = torch.cat([p.weight.detach() for p in parts])
                bias = torch.cat([p.bias.detach() for p in parts])
            rows = self.q_proj.weight.shape[0]
            for i, p in enumerate(parts):
                p.weight = nn.Parameter(weight[i * rows:(i + 1) * rows], requires_grad=False)
                p.bias = nn.Parameter(bias[i * rows:(i + 1) * rows], requires_grad=False)
            self._qkv = (weight, bias)
        return self._qkv


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias) if out is None else torch.addmm(bias, x, weight.t(), out=out)


def _residual(x: torch.Tensor, delta: torch.Tensor, buffers: SiglipBuffers | None) -> torch.Tensor:
    return x + delta if buffers is None else x.add_(delta)


def siglip_layer_names(tower: str, num_layers: int) -> dict[str, str]:
    """Our SiglipLayer parameters -> a transformers SigLIP encoder's names under `tower` (Gemma 3, Idefics3,
    LFM2-VL share the layer)."""
    names = {}
    for i in range(num_layers):
        for part in ("layer_norm1", "layer_norm2", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.out_proj", "mlp.fc1", "mlp.fc2"):
            for kind in ("weight", "bias"):
                names[f"layers.{i}.{part.split('.')[-1]}.{kind}"] = f"{tower}encoder.layers.{i}.{part}.{kind}"
    return names
