"""The model's linear layers as the forward pass multiplies by them.

On CPU each weight is reordered once into oneDNN's blocked layout, and the activation or sum that follows a
projection runs inside the same call: PyTorch's own nn.Linear goes through MKL's sgemm, which multiplies a decode
step's few rows by cold weights much slower (docs/performance.md). Elsewhere (CUDA, or a CPU and dtype oneDNN cannot
pack for) it is plain F.linear.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# A layer's adapter deltas for a step (chatq.worker.lora): a group of modules and its input -> each module's delta.
Deltas = Callable[[str, torch.Tensor], list[torch.Tensor]]


class Dense:
    """y = x W^T + b, optionally followed by silu, a product or a sum, from one nn.Linear (left as it is)."""

    def __init__(self, linear: nn.Linear, packed: bool):
        weight = linear.weight.detach()
        self.out_features = weight.shape[0]
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.packed = packed
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "swish", [], "")
        return F.silu(F.linear(x, self.weight, self.bias))

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.weight, self.bias, "mul")
        return F.linear(x, self.weight, self.bias) * other

    def plus(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.weight, self.bias, "add")
        return F.linear(x, self.weight, self.bias) + other


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and multiplies weights of this dtype here, tried once on a small weight: bf16, for one,
    needs AVX-512 (or AVX-NE-CONVERT) and raises without it."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(16, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        got = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16, dtype=dtype), packed, None, "none", [], "")
        return bool((got == 16).all())
    except RuntimeError as e:
        log.info("oneDNN does not pack %s weights on this CPU (%s): plain linear layers", dtype, e)
        return False


class Layer:
    """One decoder layer's projections."""

    def __init__(self, layer: Any, packed: bool):
        attn, mlp = layer.self_attn, layer.mlp
        self.q, self.k, self.v, self.o = (
            Dense(p, packed) for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        )
        self.mlp = mlp
        self.swiglu = getattr(attn.config, "hidden_act", None) == "silu"
        if self.swiglu:
            self.gate, self.up, self.down = (Dense(p, packed) for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))

    def qkv(self, h: torch.Tensor, adapt: Deltas | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention's projections of h, with their adapters' deltas if a step has adapters (`adapt`)."""
        if adapt is None:
            return self.q(h), self.k(h), self.v(h)
        dq, dk, dv = adapt("qkv", h)
        return self.q.plus(h, dq), self.k.plus(h, dk), self.v.plus(h, dv)

    def mlp_plus(self, x: torch.Tensor, residual: torch.Tensor, adapt: Deltas | None = None) -> torch.Tensor:
        """residual + the MLP of x: a SwiGLU MLP (Llama, Qwen, Mistral) fused here, with its adapters' deltas if
        a step has adapters (`adapt`); any other through the model's own module."""
        if not self.swiglu:
            return residual + self.mlp(x)
        if adapt is None:
            return self.down.plus(self.up.times(x, self.gate.silu(x)), residual)
        dg, du = adapt("gate_up", x)
        gate = F.silu(self.gate.plus(x, dg))
        m = self.up.times(x, gate).addcmul_(du, gate)  # (up + du) * gate, the product still fused
        return self.down.plus(m, residual + adapt("down", m)[0])
