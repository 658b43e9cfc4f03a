"""Decode attention over the paged cache: the CUDA kernel (in Triton's interpreter off a GPU) against SDPA."""

from __future__ import annotations

import pytest
import torch

from chatq.worker import attention
from tests.helpers import built_kernels

BLOCK = 16
DEV = "cuda" if torch.cuda.is_available() else "cpu"


# Half precision as float16: Triton's interpreter multiplies bfloat16 blocks wrongly (a plain 16x16 tl.dot is off by
# 1e10), while the kernel's code is the same for both 16-bit types.
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.float16, 2e-3)])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (32, 8, 128), (9, 3, 64)])
def test_paged_kernel_equals_gathered_sdpa(heads, kv_heads, head_dim, dtype, tol):
    torch.manual_seed(0)
    num_blocks = 64
    with torch.device(DEV):
        kc = torch.randn(num_blocks * BLOCK, kv_heads, head_dim, dtype=dtype)
        vc = torch.randn(num_blocks * BLOCK, kv_heads, head_dim, dtype=dtype)
        # Lengths inside one block, at block and tile edges, across several tiles; blocks scattered over the pool.
        lens = torch.tensor([1, 15, 16, 17, 64, 65, 200], dtype=torch.int32)
        table = torch.stack([torch.randperm(num_blocks)[:13] for _ in lens]).to(torch.int32)
        q = torch.randn(len(lens), heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5

    got = attention.decode_paged(q, kc, vc, table, lens, scale, BLOCK)
    assert got.dtype == dtype
    exact = [x.float() for x in (q, kc, vc)]
    want = attention.decode_sdpa(*exact, *attention.gather_context(table, lens, BLOCK), scale)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def own_keys_attention(q, kc, vc, table, lens, scale):
    """Each sequence alone, its keys read slot by slot through its block table."""
    out = []
    for b, n in enumerate(lens.tolist()):
        slots = torch.tensor([int(table[b, i // BLOCK]) * BLOCK + i % BLOCK for i in range(n)])
        k, v = kc[slots].transpose(0, 1)[None], vc[slots].transpose(0, 1)[None]  # [1, KVH, n, D]
        o = torch.nn.functional.scaled_dot_product_attention(q[b][None, :, None], k, v, scale=scale, enable_gqa=True)
        out.append(o[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize("gather_bytes", [attention.GATHER_BYTES, 1, 1_000_000])
def test_gathered_attention_equals_each_sequence_on_its_own(gather_bytes, monkeypatch):
    # Whole, a sequence per piece, and pieces of a few sequences (the last one shorter).
    monkeypatch.setattr(attention, "GATHER_BYTES", gather_bytes)
    torch.manual_seed(2)
    kc, vc = torch.randn(64 * BLOCK, 3, 64), torch.randn(64 * BLOCK, 3, 64)
    lens = torch.tensor([1, 15, 16, 17, 64, 65, 200], dtype=torch.int32)
    table = torch.stack([torch.randperm(64)[:13] for _ in lens]).to(torch.int32)
    q = torch.randn(len(lens), 9, 64)
    got = attention.decode_sdpa(q, kc, vc, *attention.gather_context(table, lens, BLOCK), 0.125)
    torch.testing.assert_close(got, own_keys_attention(q, kc, vc, table, lens, 0.125))


def test_keys_past_a_sequences_length_are_not_read():
    torch.manual_seed(1)
    with torch.device(DEV):
        kc = torch.randn(8 * BLOCK, 2, 64)
        vc = torch.randn(8 * BLOCK, 2, 64)
        table = torch.tensor([[3, 5, 0, 0]], dtype=torch.int32)
        lens = torch.tensor([20], dtype=torch.int32)
        q = torch.randn(1, 4, 64)
    before = attention.decode_paged(q, kc, vc, table, lens, 0.125, BLOCK)
    # Whatever sits in the rest of block 5 and in the blocks the table pads with is not part of the context.
    kc[5 * BLOCK + 4 : 6 * BLOCK] = 1e4
    kc[:BLOCK] = float("nan")
    vc[:BLOCK] = float("nan")
    after = attention.decode_paged(q, kc, vc, table, lens, 0.125, BLOCK)
    torch.testing.assert_close(after, before)


def test_the_kernels_start_check_measures_how_far_it_is_from_sdpa(monkeypatch):
    device = torch.device(DEV)
    assert attention.paged_decode_error(14, 2, 64, 16, torch.float32, device) < 1e-5
    assert attention.paged_decode_error(14, 2, 64, 24, torch.float32, device) == float("inf")  # tiles: powers of two

    def wrong(q, *args):
        return torch.zeros_like(q)

    monkeypatch.setattr(attention, "decode_paged", wrong)
    assert attention.paged_decode_error(14, 2, 64, 16, torch.float32, device) == 1.0

    def broken(*args):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(attention, "decode_paged", broken)
    assert attention.paged_decode_error(14, 2, 64, 16, torch.float32, device) == float("inf")


# A bf16 model's rows are bf16: its outputs differ from float32 attention over the same values by bf16's rounding.
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, None), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("kernel", ["cpu", "sdpa"])
def test_context_rows_follow_sequences_as_they_join_grow_and_leave(dtype, tol, kernel):
    # Two layers of a paged cache; sequences decode a token per step while others join (their context copied in)
    # and leave (a later row moving down into the gap), past the rows' first capacity in both sequences and tokens.
    torch.manual_seed(3)
    layers, kv_heads, head_dim, blocks = 2, 3, 64, 256
    kc = [torch.randn(blocks * BLOCK, kv_heads, head_dim, dtype=dtype) for _ in range(layers)]
    vc = [torch.randn(blocks * BLOCK, kv_heads, head_dim, dtype=dtype) for _ in range(layers)]
    with_kernel = built_kernels() if kernel == "cpu" else None
    rows = attention.ContextRows(layers, kv_heads, head_dim, BLOCK, dtype, budget=1 << 30, kernel=with_kernel)
    free = iter(torch.randperm(blocks).tolist())
    seqs: dict[str, tuple[list[int], int]] = {}  # id -> (blocks, context length)
    schedule = {0: ["a", "b", "c"], 3: ["d"], 5: [f"e{i}" for i in range(9)], 12: ["f"]}
    leaving = {4: ["a"], 7: ["c", "e3"], 10: ["b", "e0", "e8"]}
    for step in range(40):
        for i in schedule.get(step, []):
            n = int(torch.randint(1, 100, ()))
            seqs[i] = ([next(free) for _ in range(-(-n // BLOCK))], n)
        for i in leaving.get(step, []):
            del seqs[i]
        ids = list(seqs)
        for i in ids:  # this step's token, written to the paged cache as the forward pass does
            owned, n = seqs[i]
            if n % BLOCK == 0:
                owned.append(next(free))
            seqs[i] = (owned, n + 1)
        lens = torch.tensor([seqs[i][1] for i in ids], dtype=torch.int32)
        width = max(len(seqs[i][0]) for i in ids)
        table = torch.tensor([seqs[i][0] + [0] * (width - len(seqs[i][0])) for i in ids], dtype=torch.int32)
        new = [(owned[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK) for owned, n in (seqs[i] for i in ids)]
        k_new = [torch.randn(len(ids), kv_heads, head_dim, dtype=dtype) for _ in range(layers)]
        v_new = [torch.randn(len(ids), kv_heads, head_dim, dtype=dtype) for _ in range(layers)]
        for layer in range(layers):
            kc[layer][new], vc[layer][new] = k_new[layer], v_new[layer]
        at = rows.place(ids, lens, table, kc, vc)
        assert at is not None
        q = torch.randn(len(ids), 9, head_dim, dtype=dtype)
        for layer in range(layers):
            got = rows.attend(layer, q, k_new[layer], v_new[layer], at, 0.125)
            want = own_keys_attention(q.float(), kc[layer].float(), vc[layer].float(), table, lens, 0.125)
            assert got.dtype == rows.k[layer].dtype == dtype
            torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert rows.k[0].shape[0] > attention.ContextRows.ROWS and rows.k[0].shape[2] > attention.ContextRows.TOKENS


def test_context_rows_past_their_budget_leave_the_step_to_the_gather():
    kc, vc = [torch.randn(16 * BLOCK, 3, 64)], [torch.randn(16 * BLOCK, 3, 64)]
    per_row = 2 * attention.ContextRows.TOKENS * 3 * 64 * 4
    rows = attention.ContextRows(1, 3, 64, BLOCK, torch.float32, budget=attention.ContextRows.ROWS * per_row)
    table = torch.arange(16, dtype=torch.int32).view(8, 2)
    assert rows.place([str(i) for i in range(8)], torch.full((8,), 20, dtype=torch.int32), table, kc, vc)
    wide = torch.arange(16, dtype=torch.int32).view(1, 16)  # 256 tokens: twice the room of a row
    assert rows.place(["long"], torch.tensor([250], dtype=torch.int32), wide, kc, vc) is None
    assert rows.row_of == {}
