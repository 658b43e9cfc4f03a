"""Decode attention over the paged KV cache: one query token per sequence against all of its cached keys.

On CUDA a Triton kernel reads each sequence's keys in place through its block-table row, where SDPA would first
gather every context, per layer per step, at more cost than the attention at large batches. Its loop bounds come
from device-side lengths, so a CUDA graph replays it at any length. On CPU each decoding sequence's keys stay in a
contiguous row of their own (ContextRows), gathered from the blocks only where rows would take too much memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no Triton
    triton = None


def paged_decode_error(
    heads: int, kv_heads: int, head_dim: int, block: int, dtype: torch.dtype, device: torch.device
) -> float:
    """How far the Triton kernel is from SDPA at these head and block shapes on this device: the largest difference
    of their outputs over the largest output, in float32 for SDPA. Lengths cross the cache's blocks and the kernel's
    tiles, over blocks scattered through the pool; a kernel that fails to build or run is infinitely far."""
    if triton is None:
        return float("inf")
    tile = max(block, 64 // block * block)
    lens = [1, block - 1, block, block + 1, tile - 1, tile, tile + 1, 2 * tile + block + 3, 17 * tile - 5]
    pool = -(-max(lens) // block) * 2
    gen = torch.Generator().manual_seed(0)
    try:
        kc, vc = (torch.randn(pool * block, kv_heads, head_dim, generator=gen).to(device, dtype) for _ in range(2))
        q = torch.randn(len(lens), heads, head_dim, generator=gen).to(device, dtype)
        table = torch.stack([torch.randperm(pool, generator=gen)[: pool // 2] for _ in lens]).to(device, torch.int32)
        lengths = torch.tensor(lens, dtype=torch.int32, device=device)
        scale = head_dim**-0.5
        got = decode_paged(q, kc, vc, table, lengths, scale, block).float()
        want = decode_sdpa(q.float(), kc.float(), vc.float(), *gather_context(table, lengths, block), scale)
        error = float((got - want).abs().max() / want.abs().max())
    except Exception:
        log.exception("the paged decode kernel failed to run")
        return float("inf")
    return error if error == error else float("inf")  # NaN: as wrong as can be


def gather_context(table: torch.Tensor, lens: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block ids [B, W] of every sequence's context, W the widest sequence's block count, and the mask
    [B, 1, 1, W * block_size] of the slots that hold its tokens."""
    width = -(-int(lens.max()) // block_size) if lens.numel() else 0
    offsets = torch.arange(width * block_size, device=table.device)
    mask = (offsets[None, :] < lens[:, None])[:, None, None, :]
    return table[:, :width], mask


# Bytes of keys and values gathered at once on CPU: a piece that stays in cache between the copy and the attention
# reading it, where a whole large batch's context would make both go out to memory. A GPU gathers the batch at once,
# since a piece per few rows would cost it a launch of each kernel per piece.
GATHER_BYTES = 4 << 20


def decode_sdpa(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, H, D]; kc, vc [slots, KVH, D]; ctx, mask from gather_context. Returns [B, H, D]."""
    batch, width = ctx.shape
    block = mask.shape[-1] // max(width, 1)
    per_row = 2 * width * block * kc[0].numel() * kc.element_size()
    rows = max(1, GATHER_BYTES // max(per_row, 1))
    if rows >= batch or q.is_cuda:
        return _decode_sdpa(q, kc, vc, ctx, mask, scale, block)
    out = torch.empty_like(q)
    for i in range(0, batch, rows):
        out[i : i + rows] = _decode_sdpa(q[i : i + rows], kc, vc, ctx[i : i + rows], mask[i : i + rows], scale, block)
    return out


def _decode_sdpa(q, kc, vc, ctx, mask, scale: float, block: int) -> torch.Tensor:
    batch, width = ctx.shape
    # Whole blocks, one contiguous copy each: gathering slot by slot moves the same bytes in 16 times the pieces.
    flat = ctx.flatten()
    k = kc.view(-1, block, *kc.shape[1:]).index_select(0, flat).view(batch, width * block, *kc.shape[1:])
    v = vc.view(-1, block, *vc.shape[1:]).index_select(0, flat).view(batch, width * block, *vc.shape[1:])
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o.squeeze(2)


@dataclass
class Placement:
    """Where one step's decoding sequences sit in the context rows: sequence j of the batch in row `rows[j]`; rows
    0..D-1 are all in use."""

    rows: torch.Tensor  # [D]
    lens: torch.Tensor  # [D] int64 context lengths, new token included
    width: int
    # SDPA's alone (the kernel writes and masks for itself): where each sequence's new key and value of each KV head
    # go in a layer's rows [D * KVH], and the additive mask [D, 1, 1, width] in row order, -inf past a row's tokens.
    writes: torch.Tensor | None = None
    mask: torch.Tensor | None = None


class ContextRows:
    """Each decoding sequence's keys and values kept in a contiguous row of their own, on CPU.

    Gathering every context from the paged cache, per layer per step, costs more than the attention that reads it;
    here a sequence's context is copied once, when it starts decoding, and each step adds its new token. A sequence
    missing from a step loses its row. The rows take at most `budget` bytes: a batch that needs more gathers. A step
    that fails part way has written only its new tokens' places, which the step run again writes over.

    Rows are in the model's dtype and the paged cache's layout. Attention over them is `kernel`'s (cpu_kernels), or
    else SDPA's; both keep scores and sums in float32 over bf16 keys and values.
    """

    ROWS, TOKENS = 8, 128  # capacity grows in these steps

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        budget: int,
        kernel: Any | None = None,
    ):
        self.layers, self.kv_heads, self.head_dim, self.block = layers, kv_heads, head_dim, block_size
        self.dtype, self.budget, self.kernel = dtype, budget, kernel
        self.k: list[torch.Tensor] = []  # per layer [rows, kv_heads, tokens, head_dim]
        self.v: list[torch.Tensor] = []
        self.row_of: dict[str, int] = {}

    def clear(self) -> None:
        """Forgets every row (their memory is kept for the next sequences)."""
        self.row_of = {}

    def place(
        self,
        ids: list[str],
        lens: torch.Tensor | None,
        table: torch.Tensor | None,
        kc: list[torch.Tensor],
        vc: list[torch.Tensor],
    ) -> Placement | None:
        """Rows for this step's decoding sequences (ids, context lengths with the new token, block table), their
        earlier tokens copied from the paged cache (kc, vc per layer); None where there are none or they would not
        fit the budget."""
        alive = set(ids)
        self.row_of = {i: r for i, r in self.row_of.items() if i in alive}
        width = 0 if table is None else table.shape[1] * self.block
        if not ids or lens is None or table is None or not self._reserve(len(ids), width):
            self.clear()
            return None
        self._compact(len(ids))
        self._join([j for j, i in enumerate(ids) if i not in self.row_of], ids, table, width, kc, vc)
        rows = torch.tensor([self.row_of[i] for i in ids])
        at = Placement(rows, lens.long(), width)
        if self.kernel is None:
            row_lens = torch.empty_like(lens).index_copy_(0, rows, lens)
            at.mask = torch.zeros(len(ids), 1, 1, width, dtype=self.dtype)
            at.mask.masked_fill_(torch.arange(width) >= row_lens[:, None, None, None], float("-inf"))
            # index_copy_ into the flat rows: advanced indexing writes the same keys at about half the speed.
            heads, tokens = self.kv_heads, self.k[0].shape[2]
            at.writes = ((rows[:, None] * heads + torch.arange(heads)) * tokens + (at.lens - 1)[:, None]).flatten()
        return at

    def _reserve(self, rows: int, tokens: int) -> bool:
        """Room for `rows` rows of `tokens` tokens, keeping what the rows hold; False past the budget."""
        have_rows, have_tokens = (self.k[0].shape[0], self.k[0].shape[2]) if self.k else (0, 0)
        if rows <= have_rows and tokens <= have_tokens:
            return True
        rows = max(have_rows, -(-rows // self.ROWS) * self.ROWS)
        tokens = max(have_tokens, -(-tokens // self.TOKENS) * self.TOKENS)
        if 2 * self.layers * rows * self.kv_heads * tokens * self.head_dim * self.dtype.itemsize > self.budget:
            return False

        def grown(old: torch.Tensor | None) -> torch.Tensor:
            new = torch.zeros(rows, self.kv_heads, tokens, self.head_dim, dtype=self.dtype)
            if old is not None:
                new[: old.shape[0], :, : old.shape[2]] = old
            return new

        none: list[torch.Tensor | None] = [None] * self.layers
        # Both built before either is kept: running out of memory half way must leave the old rows whole.
        k, v = [grown(old) for old in self.k or none], [grown(old) for old in self.v or none]
        self.k, self.v = k, v
        return True

    def _compact(self, count: int) -> None:
        """Moves the sequences in rows past `count` into free rows below it, so that attention reads rows 0..count-1."""
        taken = set(self.row_of.values())
        free = iter(r for r in range(count) if r not in taken)
        moves = [(i, r, next(free)) for i, r in self.row_of.items() if r >= count]
        if not moves:
            return
        src, dst = (torch.tensor([m[k] for m in moves]) for k in (1, 2))
        for rows in (*self.k, *self.v):
            rows.index_copy_(0, dst, rows.index_select(0, src))
        self.row_of.update({i: d for i, _, d in moves})

    def _join(
        self,
        joining: list[int],
        ids: list[str],
        table: torch.Tensor,
        width: int,
        kc: list[torch.Tensor],
        vc: list[torch.Tensor],
    ) -> None:
        """Copies the contexts of the batch's sequences `joining` (indices into ids) into free rows below len(ids)."""
        if not joining:
            return
        taken = set(self.row_of.values())
        free = [r for r in range(len(ids)) if r not in taken][: len(joining)]
        blocks = table[joining].flatten()
        rows = torch.tensor(free)
        for cache, kept in ((kc, self.k), (vc, self.v)):
            for layer, whole in enumerate(cache):
                ctx = whole.view(-1, self.block, *whole.shape[1:]).index_select(0, blocks)
                ctx = ctx.view(len(joining), width, *whole.shape[1:]).transpose(1, 2)
                kept[layer][:, :, :width].index_copy_(0, rows, ctx)
        self.row_of.update({ids[j]: r for j, r in zip(joining, free, strict=True)})

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: Placement, scale: float
    ) -> torch.Tensor:
        """q [D, H, head_dim] and the step's new k, v [D, KVH, head_dim] in batch order. Returns [D, H, head_dim]."""
        kr, vr = self.k[layer], self.v[layer]
        if self.kernel is not None:
            return self.kernel.attend(q.contiguous(), k.contiguous(), v.contiguous(), kr, vr, at.rows, at.lens, scale)
        assert at.writes is not None
        kr.view(-1, self.head_dim).index_copy_(0, at.writes, k.reshape(-1, self.head_dim))
        vr.view(-1, self.head_dim).index_copy_(0, at.writes, v.reshape(-1, self.head_dim))
        count, heads = q.shape[:2]
        by_row = torch.empty_like(q).index_copy_(0, at.rows, q)
        # A step has one query per sequence: a KV head's query heads go in as its queries, reading each key once.
        grouped = by_row.view(count, self.kv_heads, heads // self.kv_heads, self.head_dim)
        o = F.scaled_dot_product_attention(
            grouped, kr[:count, :, : at.width], vr[:count, :, : at.width], attn_mask=at.mask, scale=scale
        )
        return o.view(count, heads, self.head_dim).index_select(0, at.rows)


if triton is not None:
    # The table's row stride (the widest sequence's block count) changes every step; Triton would specialize on
    # whether it is 1 or divisible by 16 and recompile mid-run.
    @triton.jit(do_not_specialize=["stride_tb"])
    def _paged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        lens_ptr,
        out_ptr,
        scale,
        stride_qb,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_tb,
        stride_ob,
        stride_oh,
        GROUP: tl.constexpr,  # query heads per KV head
        GROUP_PAD: tl.constexpr,  # at least 16: tl.dot's smallest tile
        HEAD_DIM: tl.constexpr,
        PAGE: tl.constexpr,  # tokens per cache block
        TILE: tl.constexpr,  # keys per iteration, a multiple of PAGE
        PRECISION: tl.constexpr,  # of tl.dot on float32 inputs
    ):
        # One program per (sequence, KV head): the query heads sharing that KV head read each key once.
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        length = tl.load(lens_ptr + b)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g[:, None] < GROUP, other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        den = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for start in range(0, length, TILE):
            pos = start + tl.arange(0, TILE)
            valid = pos < length
            block = tl.load(table_ptr + b * stride_tb + pos // PAGE, mask=valid, other=0)
            slot = block.to(tl.int64) * PAGE + pos % PAGE
            kv_off = slot[:, None] * stride_ks + kvh * stride_kh + d[None, :]
            k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # [GROUP_PAD, TILE]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            den = den * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            m = m_new
        out = acc / den[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g[:, None] < GROUP,
        )


def decode_paged(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """q [B, H, D]; kc, vc [slots, KVH, D]; table [B, W] int32 block ids; lens [B] int32 (each >= 1)."""
    batch, heads, head_dim = q.shape
    kv_heads = kc.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    tile = max(block_size, 64 // block_size * block_size)
    _paged_decode_kernel[(batch, kv_heads)](
        q,
        kc,
        vc,
        table,
        lens,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        kc.stride(0),
        kc.stride(1),
        table.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        PAGE=block_size,
        TILE=tile,
        # Triton multiplies float32 in TF32 by default, about three decimal digits: a float32 model (CHATQ_DTYPE)
        # would then attend less exactly than torch's own float32 matmuls and drift from transformers' output.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
