"""One batched forward pass over a paged KV cache, for Llama-style decoder models (Llama, Qwen2/3, Mistral, SmolLM).

transformers provides the layers and weights but no forward in which each sequence has its own length and place in
a shared cache, so sequences can join and leave between steps. Here all tokens form one flat row, each writes its
K/V into slots the block manager chose, and attention reads each sequence's slots back.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from chatq.worker import attention, cpu_kernels, dense, lora

# A CPU decode's context: its place in the context rows, or else the block ids [D, W] and the mask of the slots in
# use that gathering it takes (attention.gather_context).
Context = attention.Placement | tuple[torch.Tensor, torch.Tensor]


class Interrupted(Exception):
    """The pass was given up between two layers because its `stop` was set: nothing it computed is used, and the
    cache slots it wrote are written again by the pass that takes its place."""


@dataclass
class Batch:
    """What one step feeds the model. Decode tokens come first (one per sequence), then prefill chunks."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] cache slot each token's K/V is written to
    # Decode part: D sequences with one query token each, reading the first `dec_lens` slots of their blocks.
    num_decode: int
    dec_table: torch.Tensor | None  # [D, W] int32 block ids
    dec_lens: torch.Tensor | None  # [D] int32 context lengths, new token included
    # Prefill part: per chunk, its (start, end) in the flat row and the slots of its context, the chunk's own tokens
    # last: query i of a chunk of n sees the context's first len(context) - n + i + 1 keys (a lower-right causal mask).
    prefills: list[tuple[int, int, torch.Tensor]]
    logits_at: torch.Tensor | None  # [S] rows of the flat row whose next-token logits are needed; None: all
    dec_ids: list[str] = field(default_factory=list)  # [D] the decoding sequences' ids (CPU context rows)
    lora_rows: lora.Rows | None = None  # its tokens gathered by adapter; None: no adapter in the step


class KVCache:
    """K and V for every layer, addressed by slot = block * block_size + offset.

    One block more than the block manager hands out: the padding rows of a fixed-size (CUDA graph) batch write and
    read there, so they never touch a live sequence's cache.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype, device):
        self.block_size = block_size
        self.spare_block = num_blocks
        shape = ((num_blocks + 1) * block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.bytes = 2 * num_layers * self.k[0].numel() * self.k[0].element_size()

    def copy_block(self, source: int, target: int) -> None:
        """Every layer's K and V of block `source` into block `target`."""
        bs = self.block_size
        for cache in self.k + self.v:
            cache[target * bs : (target + 1) * bs] = cache[source * bs : (source + 1) * bs]

    @staticmethod
    def bytes_per_token(config, dtype: torch.dtype) -> int:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, flash: bool | None = None
) -> torch.Tensor:
    """A prompt chunk's attention: q [1, H, n, D] over its context k, v [1, KVH, L, D], whose last n keys are the
    chunk's own. A chunk that starts the context is plainly causal; one that continues it (the next chunk of a long
    prompt, a prompt after a prefix-cache hit) is causal from the lower right. `flash`: through the bias object
    (by default on CUDA in 16-bit types, where SDPA's flash kernel takes it), else through a mask."""
    n, length = q.shape[2], k.shape[2]
    if n == length:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    if flash is None:
        flash = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if flash:
        # Grouped K/V heads and all, with no mask in memory.
        bias = causal_lower_right(n, length)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
    # A mask has no flash kernel, and grouped heads no memory-efficient one, which would leave SDPA's math kernel with
    # its huge scores: repeating the K/V heads costs one copy of the context.
    mask = torch.arange(length, device=q.device)[None, :] <= torch.arange(length - n, length, device=q.device)[:, None]
    if (groups := q.shape[1] // k.shape[1]) > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class PagedForward:
    def __init__(self, model: nn.Module, cache: KVCache):
        self.model = model
        self.cache = cache
        # Any: nn.Module's __getattr__ types every submodule as `Tensor | Module`, which no call or attribute passes.
        inner: Any = model.model
        self.embed = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        from importlib import import_module

        # Rotary application is the one function each architecture module defines; take the model's own.
        self.apply_rotary = import_module(type(model).__module__).apply_rotary_pos_emb
        kc = cache.k[0]
        self.heads = attn.config.num_attention_heads
        # Decode attention by the Triton kernel over the paged cache; the engine's start check (selfcheck) turns it off
        # where it disagrees with SDPA.
        self.paged = kc.is_cuda and attention.triton is not None
        if kc.is_cuda:
            # Where torch prefers cuDNN's attention (Hopper, recent cuDNN) it builds a costly plan for each new pair of
            # prompt and context lengths, and a server keeps seeing new ones.
            torch.backends.cuda.enable_cudnn_sdp(False)
        # On CPU decode attention reads context rows, of as much memory again as the paged cache at most.
        self.rows = None
        self.kernels: Any = cpu_kernels.load() if kc.device.type == "cpu" else None
        if kc.device.type == "cpu":
            shape = (len(self.layers), kc.shape[1], self.head_dim, cache.block_size, kc.dtype)
            runs = self.kernels is not None and cpu_kernels.attention_runs(self.head_dim, kc.dtype)
            self.rows = attention.ContextRows(*shape, budget=cache.bytes, kernel=self.kernels if runs else None)
        norms = [n for layer in self.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        self.fused_norm = (
            self.kernels is not None
            and all(type(n) is type(self.norm) for n in norms)
            and cpu_kernels.computes_norm(self.kernels, self.norm, inner.config.hidden_size, kc.dtype)
        )
        self.fused_rotary = self.kernels is not None and cpu_kernels.computes_rotary(
            self.kernels, self.rotary, self.apply_rotary, (self.heads, kc.shape[1], self.head_dim), kc.dtype
        )
        packed = dense.can_pack(kc.device, kc.dtype)
        self.dense = [dense.Layer(layer, packed) for layer in self.layers]
        lm_head: Any = model.lm_head
        self.head = dense.Dense(lm_head, packed)
        self.lora: lora.Resident | None = None  # the adapters it holds, once the engine gives it some

    @torch.inference_mode()
    def __call__(self, b: Batch, out: torch.Tensor | None = None, stop: threading.Event | None = None) -> torch.Tensor:
        """Next-token logits (float32) of the rows `b.logits_at` names, written into `out` if given. Decode-only
        batches make no host sync on CUDA, so the same call can be captured in a CUDA graph. Raises Interrupted
        before a layer once `stop` is set."""
        ctx = None if self.paged else self._context(b)
        h = self.embed(b.input_ids)  # [T, hidden]
        cos, sin = self.rotary(h, b.positions[None])
        cos, sin = cos[0], sin[0]  # [T, head_dim]
        for i, (layer, proj) in enumerate(zip(self.layers, self.dense, strict=True)):
            if stop is not None and stop.is_set():
                raise Interrupted
            adapt = None if self.lora is None or b.lora_rows is None else lora.LayerDeltas(self.lora, b.lora_rows, i)
            x = self._norm(layer.input_layernorm, h)
            a = self._attention(layer.self_attn, proj, x, cos, sin, i, b, ctx, adapt)
            h = proj.o.plus(a, h if adapt is None else h + adapt("o", a)[0])
            x = self._norm(layer.post_attention_layernorm, h)
            h = proj.mlp_plus(x, h, adapt)
        h = self._norm(self.norm, h if b.logits_at is None else h[b.logits_at])
        logits = self.head(h)
        return logits.float() if out is None else out.copy_(logits)

    def _norm(self, norm: Any, h: torch.Tensor) -> torch.Tensor:
        if self.fused_norm:
            return self.kernels.rms_norm(h, norm.weight, norm.variance_epsilon)
        return norm(h)

    def _context(self, b: Batch) -> Context | None:
        """Where decode attention without the paged kernel reads its keys: the context rows, or else a gather."""
        placed = None
        if self.rows is not None:
            placed = self.rows.place(b.dec_ids, b.dec_lens, b.dec_table, self.cache.k, self.cache.v)
        if placed or not b.num_decode:
            return placed
        assert b.dec_table is not None and b.dec_lens is not None
        return attention.gather_context(b.dec_table, b.dec_lens, self.cache.block_size)

    def _attention(
        self,
        attn: Any,
        proj: dense.Layer,
        h: torch.Tensor,
        cos,
        sin,
        layer: int,
        b: Batch,
        ctx: Context | None,
        adapt: dense.Deltas | None,
    ) -> torch.Tensor:
        """Attention's output for every token, before the output projection."""
        t = h.shape[0]
        q, k, v = proj.qkv(h, adapt)
        q, k, v = q.view(t, -1, self.head_dim), k.view(t, -1, self.head_dim), v.view(t, -1, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3-style per-head norms
            q, k = attn.q_norm(q), attn.k_norm(k)
        if self.fused_rotary:
            q, k = q.contiguous(), k.contiguous()
            self.kernels.rotary(q, k, cos, sin)
        else:  # apply_rotary_pos_emb wants heads before tokens; here tokens lead, so broadcast cos/sin over dim 1.
            q, k = self.apply_rotary(q, k, cos, sin, unsqueeze_dim=1)
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc.index_copy_(0, b.slots, k)
        vc.index_copy_(0, b.slots, v)
        d = b.num_decode
        if d == t:  # decode only: no copy into a shared output
            return self._decode(q, k, v, layer, b, ctx).reshape(t, -1)
        out = torch.empty_like(q)
        if d:
            out[:d] = self._decode(q[:d], k[:d], v[:d], layer, b, ctx)
        for start, end, context in b.prefills:
            kp = kc.index_select(0, context).transpose(0, 1)[None]  # [1, kvh, L, hd]
            vp = vc.index_select(0, context).transpose(0, 1)[None]
            o = prefill_attention(q[start:end].transpose(0, 1)[None], kp, vp, self.scaling)
            out[start:end] = o[0].transpose(0, 1)
        return out.reshape(t, -1)

    def _decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, b: Batch, ctx: Context | None
    ) -> torch.Tensor:
        """Decode attention of the step's first q.shape[0] tokens, whose new k, v the paged cache already holds."""
        if isinstance(ctx, attention.Placement):
            assert self.rows is not None
            return self.rows.attend(layer, q, k, v, ctx, self.scaling)
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        if ctx is not None:
            return attention.decode_sdpa(q, kc, vc, ctx[0], ctx[1], self.scaling)
        assert b.dec_table is not None and b.dec_lens is not None
        return attention.decode_paged(q, kc, vc, b.dec_table, b.dec_lens, self.scaling, self.cache.block_size)
