"""One batched forward pass over a paged KV cache, for Llama-style decoder models (Llama, Qwen2/3, Mistral, SmolLM).

transformers provides the layers (projections, norms, MLP, rotary embedding) and their weights; what it lacks is a
forward in which every sequence of the batch has its own length and its own place in a shared cache, so that
sequences join and leave between steps. That part is here: tokens of all sequences are flattened into one row,
each writes its K/V into cache slots chosen by the block manager, and attention reads each sequence's slots back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Batch:
    """What one step feeds the model. Decode tokens come first (one per sequence), then prefill chunks."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] cache slot each token's K/V is written to
    # Decode part: D sequences with one query token each, reading `dec_ctx` slots masked by `dec_mask`.
    num_decode: int
    dec_ctx: torch.Tensor | None  # [D, Lmax] slot ids
    dec_mask: torch.Tensor | None  # [D, 1, 1, Lmax] True where attended
    # Prefill part: (start, end) of each chunk in the flat row, its context slots, and its causal mask.
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]]
    logits_at: torch.Tensor  # [S] rows of the flat row whose next-token logits are needed


class KVCache:
    """K and V for every layer, addressed by slot = block * block_size + offset."""

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype, device):
        shape = (num_slots, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(config, dtype: torch.dtype) -> int:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


class PagedForward:
    def __init__(self, model: nn.Module, cache: KVCache):
        self.model = model
        self.cache = cache
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        from importlib import import_module

        # Rotary application is the one function each architecture module defines; take the model's own.
        self.apply_rotary = import_module(type(model).__module__).apply_rotary_pos_emb

    @torch.inference_mode()
    def __call__(self, b: Batch) -> torch.Tensor:
        h = self.embed(b.input_ids)  # [T, hidden]
        cos, sin = self.rotary(h, b.positions[None])
        cos, sin = cos[0], sin[0]  # [T, head_dim]
        for i, layer in enumerate(self.layers):
            residual = h
            h = layer.input_layernorm(h)
            h = residual + self._attention(layer.self_attn, h, cos, sin, i, b)
            residual = h
            h = residual + layer.mlp(layer.post_attention_layernorm(h))
        h = self.norm(h[b.logits_at])
        return self.lm_head(h).float()

    def _attention(self, attn: nn.Module, h: torch.Tensor, cos, sin, layer: int, b: Batch) -> torch.Tensor:
        t = h.shape[0]
        q = attn.q_proj(h).view(t, -1, self.head_dim)
        k = attn.k_proj(h).view(t, -1, self.head_dim)
        v = attn.v_proj(h).view(t, -1, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3-style per-head norms
            q, k = attn.q_norm(q), attn.k_norm(k)
        # apply_rotary_pos_emb wants heads before tokens; here tokens lead, so broadcast cos/sin over dim 1.
        q, k = self.apply_rotary(q, k, cos, sin, unsqueeze_dim=1)
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc[b.slots] = k
        vc[b.slots] = v
        out = torch.empty_like(q)
        d = b.num_decode
        if d:
            # index_select rather than advanced indexing: the same gather, several times faster on CPU.
            flat = b.dec_ctx.flatten()
            shape = (*b.dec_ctx.shape, *kc.shape[1:])
            kd = kc.index_select(0, flat).view(shape).transpose(1, 2)  # [D, kvh, L, hd]
            vd = vc.index_select(0, flat).view(shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[:d].unsqueeze(2), kd, vd, attn_mask=b.dec_mask, scale=self.scaling, enable_gqa=True
            )
            out[:d] = o.squeeze(2)
        for start, end, ctx, mask in b.prefills:
            kp = kc.index_select(0, ctx).transpose(0, 1)[None]  # [1, kvh, L, hd]
            vp = vc.index_select(0, ctx).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1)[None],
                kp,
                vp,
                attn_mask=mask,
                scale=self.scaling,
                enable_gqa=True,
            )
            out[start:end] = o[0].transpose(0, 1)
        return attn.o_proj(out.reshape(t, -1))
