"""chatq's CPU kernels against what they replace: SDPA, and the model's own RMSNorm and rotary embedding."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from chatq.worker import cpu_kernels
from tests.helpers import built_kernels


# bf16 output is rounded to bf16 once: within its 2**-8 of float32 attention over the same values.
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (14, 2, 64), (4, 4, 128)])
def test_attend_writes_the_new_token_and_equals_each_sequence_on_its_own(heads, kv_heads, head_dim, dtype, tol):
    torch.manual_seed(4)
    tokens = 300
    k, v = (torch.randn(6, kv_heads, tokens, head_dim).to(dtype) for _ in range(2))
    k_rows, v_rows = k.clone(), v.clone()
    # Sequences in rows out of order, of one token, a few, and the whole row.
    rows, lens = torch.tensor([3, 0, 5, 1]), torch.tensor([1, 17, tokens, 130])
    q = torch.randn(4, heads, head_dim).to(dtype)
    k_new, v_new = (torch.randn(4, kv_heads, head_dim).to(dtype) for _ in range(2))
    got = built_kernels().attend(q, k_new, v_new, k_rows, v_rows, rows, lens, head_dim**-0.5)
    assert got.dtype == dtype and got.shape == q.shape
    k[rows, :, lens - 1], v[rows, :, lens - 1] = k_new, v_new
    assert torch.equal(k_rows, k) and torch.equal(v_rows, v)
    for j in range(4):
        kj, vj = (x[rows[j], :, : lens[j]].float() for x in (k, v))
        want = torch.nn.functional.scaled_dot_product_attention(
            q[j].float()[:, None], kj, vj, scale=head_dim**-0.5, enable_gqa=True
        )[:, 0]
        torch.testing.assert_close(got[j].float(), want, atol=tol, rtol=tol)


def test_attend_refuses_a_length_past_its_row():
    k_rows, v_rows, new = torch.zeros(2, 3, 16, 64), torch.zeros(2, 3, 16, 64), torch.ones(1, 3, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        built_kernels().attend(
            torch.zeros(1, 9, 64), new, new, k_rows, v_rows, torch.tensor([1]), torch.tensor([17]), 0.125
        )
    assert not k_rows.any() and not v_rows.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 32, 300])  # a step's rows run on one thread, a prompt's on all
def test_rms_norm_computes_the_models_norm(dtype, rows):
    torch.manual_seed(5)
    norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    torch.nn.init.normal_(norm.weight, 1.0, 0.5)
    x = (torch.randn(rows, 576) * 3).to(dtype)
    with torch.inference_mode():
        got, want = built_kernels().rms_norm(x, norm.weight, norm.variance_epsilon), norm(x)
    assert got.dtype == dtype
    # float32 sums the squares in another order; bf16 rounds the same sum the same way nearly always.
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (32, 8, 128)])
def test_rotary_computes_the_models_rotation_in_place(dtype, heads, kv_heads, head_dim):
    torch.manual_seed(6)
    q, k = (torch.randn(70, h, head_dim).to(dtype) for h in (heads, kv_heads))
    angles = torch.arange(70)[:, None] * torch.rand(head_dim // 2)
    cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype) for f in (torch.cos, torch.sin))
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    built_kernels().rotary(q, k, cos, sin)
    # Rounded where transformers rounds: the same values.
    torch.testing.assert_close(q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-6, atol=1e-6)


def test_a_norm_of_another_form_is_left_to_the_model():
    class OffsetNorm(LlamaRMSNorm):  # Gemma's form: the weight stored as an offset from one
        def forward(self, x):
            return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    with torch.inference_mode():
        kernels = built_kernels()
        assert cpu_kernels.computes_norm(kernels, LlamaRMSNorm(64, eps=1e-6), 64, torch.float32)
        assert not cpu_kernels.computes_norm(kernels, OffsetNorm(64, eps=1e-6), 64, torch.float32)


def test_a_rotation_of_another_form_is_left_to_the_model():
    def interleaved(q, k, cos, sin, unsqueeze_dim=1):  # GPT-J's pairs of neighbours rather than halves
        def rot(x):
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack([-pairs[..., 1], pairs[..., 0]], -1).flatten(-2)

        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    kernels = built_kernels()
    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3))
    for dtype in (torch.float32, torch.bfloat16):
        assert cpu_kernels.computes_rotary(kernels, rotary, apply_rotary_pos_emb, (9, 3, 64), dtype)
        assert not cpu_kernels.computes_rotary(kernels, rotary, interleaved, (9, 3, 64), dtype)


def test_a_build_or_check_that_fails_leaves_the_forward_to_torch(monkeypatch):
    from torch.utils import cpp_extension

    assert cpu_kernels.load.__wrapped__() is not None
    monkeypatch.setattr(cpu_kernels, "_attention_error", lambda kernels, dtype: 1.0)
    assert cpu_kernels.load.__wrapped__() is None

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: g++: not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    assert cpu_kernels.load.__wrapped__() is None


def test_a_build_killed_part_way_leaves_the_next_to_finish(tmp_path):
    # Killed while building, a process leaves torch's lock file in the build directory.
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    load = [sys.executable, "-c", "from chatq.worker import cpu_kernels; assert cpu_kernels.load() is not None"]
    first = subprocess.Popen(load, env=env, start_new_session=True)
    deadline = time.monotonic() + 120
    while not any(tmp_path.glob("*/lock")) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    held = any(tmp_path.glob("*/lock"))
    with contextlib.suppress(ProcessLookupError):  # the build, its compiler with it
        os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert held, "the first build was not caught holding torch's lock"
    subprocess.run(load, env=env, timeout=240, check=True)


def test_builds_unused_for_a_month_are_deleted_unless_held(tmp_path):
    now = time.time()
    for name in ("chatq_old", "chatq_recent", "chatq_held", "other_old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "chatq.lock").touch()
        (tmp_path / name / "chatq.so").write_bytes(b"\0" * 64)
    for name in ("chatq_old", "chatq_held", "other_old"):
        os.utime(tmp_path / name / "chatq.lock", (now - 31 * 86400,) * 2)
    os.utime(tmp_path / "chatq_recent" / "chatq.lock", (now - 29 * 86400,) * 2)
    with open(tmp_path / "chatq_held" / "chatq.lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        cpu_kernels._prune_unused(tmp_path, now)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chatq_held", "chatq_recent", "other_old"]


def test_loading_keeps_its_own_build_and_deletes_those_unused_for_a_month():
    built_kernels()
    root, month_ago = cpu_kernels._build_root(), time.time() - 31 * 86400
    own, stale = root / cpu_kernels._build_name(), root / "chatq_000000000000"
    stale.mkdir(exist_ok=True)
    for directory in (own, stale):
        (directory / "chatq.lock").touch()
        os.utime(directory / "chatq.lock", (month_ago, month_ago))
    assert cpu_kernels.load.__wrapped__() is not None
    assert own.is_dir() and not stale.exists()


@pytest.mark.parametrize("dtype", cpu_kernels.DTYPES)
def test_lora_computes_each_runs_products_and_leaves_other_rows(dtype):
    assert cpu_kernels.computes_lora(built_kernels(), dtype)


def test_lora_refuses_a_run_past_the_rows():
    x, a = torch.zeros(4, 8), torch.zeros(2, 8, 4)
    with pytest.raises(RuntimeError, match="outside the slots or rows"):
        built_kernels().lora(x, a, [torch.zeros(2, 4, 3)], [torch.zeros(4, 3)], torch.tensor([[1, 2, 5]]))
