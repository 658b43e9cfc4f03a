"""The forward pass's linear layers: oneDNN's packed weights on CPU against nn.Linear's own product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chatq.worker import dense

CPU = torch.device("cpu")


def linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    torch.manual_seed(n_in + n_out)
    return nn.Linear(n_in, n_out, bias=bias)


def test_float32_weights_are_packed_wherever_torch_has_onednn():
    # Else every step would quietly fall back to nn.Linear's slower product.
    assert dense.can_pack(CPU, torch.float32) == torch.backends.mkldnn.is_available()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("packed", [True, False])
def test_every_form_equals_the_plain_product(packed, rows, bias):
    if packed and not dense.can_pack(CPU, torch.float32):
        pytest.skip("oneDNN cannot pack float32 weights on this CPU")
    layer = linear(96, 80, bias)
    d = dense.Dense(layer, packed)
    x, other = torch.randn(rows, 96), torch.randn(rows, 80)
    with torch.inference_mode():
        plain = layer(x)
        for got, want in [
            (d(x), plain),
            (d.silu(x), F.silu(plain)),
            (d.times(x, other), plain * other),
            (d.plus(x, other), plain + other),
        ]:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert d.out_features == 80


def test_the_mlp_and_its_residual_equal_the_models_own(monkeypatch):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, layer_idx=0).eval()
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    with torch.inference_mode():
        want = residual + layer.mlp(x)
        for packed in (True, False):
            if packed and not dense.can_pack(CPU, torch.float32):
                continue
            torch.testing.assert_close(dense.Layer(layer, packed).mlp_plus(x, residual), want, atol=1e-5, rtol=1e-5)


def test_a_dtype_onednn_cannot_pack_runs_plain(monkeypatch):
    def refuses(*_args):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuses)
    assert not dense.can_pack(CPU, torch.bfloat16)
    assert not dense.can_pack(torch.device("cuda"), torch.float32)  # cuBLAS needs no packing
