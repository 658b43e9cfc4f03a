"""A prompt chunk's attention over its context, through the flash path's bias and through a mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chatq.worker.forward import prefill_attention


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Each query on its own: query i of a chunk of n over a context of L sees the first L - n + i + 1 keys."""
    n, length, groups = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    rows = []
    for i in range(n):
        seen = length - n + i + 1
        rows.append(F.scaled_dot_product_attention(q[:, :, i : i + 1], k[:, :, :seen], v[:, :, :seen], scale=scale))
    return torch.cat(rows, dim=2)


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize(("n", "length"), [(7, 7), (5, 40), (16, 17), (1, 33)])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4)])
def test_a_chunk_sees_its_context_and_its_own_earlier_tokens(flash, n, length, heads, kv_heads):
    torch.manual_seed(0)
    q = torch.randn(1, heads, n, 32)
    k, v = torch.randn(1, kv_heads, length, 32), torch.randn(1, kv_heads, length, 32)
    got = prefill_attention(q, k, v, 32**-0.5, flash=flash)
    torch.testing.assert_close(got, reference(q, k, v, 32**-0.5), atol=1e-5, rtol=1e-5)
