"""The start check of a CUDA engine, run here on CPU: the Triton kernel in Triton's interpreter, the graph buffers
replayed uncaptured, on a small random-weight Llama (the interpreter takes seconds a step on the default model);
faults are planted in the path under test."""

from __future__ import annotations

import pytest
import torch

from chatq.worker import attention, selfcheck
from chatq.worker.engine import Engine
from chatq.worker.graphs import DecodeGraphs
from tests.helpers import build_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def checked(model, graph_batch: int = 4) -> tuple[Engine, list[selfcheck.Check]]:
    """An engine on the CUDA path's code, as a CUDA worker starts it."""
    engine = Engine(model, kv_tokens=4096, block_size=16, prefill_chunk=256, max_model_len=2048)
    engine.forward.paged = True
    return engine, selfcheck.start(engine, model, graph_batch)


def test_an_engine_whose_fast_paths_agree_keeps_them_all(model):
    engine, checks = checked(model)
    assert engine.mode == "graphs"
    assert [c.passed for c in checks] == [True, True, True]
    assert "relative error" in checks[0].detail and "3 buckets up to 4" in checks[1].detail
    # The check's sequences left nothing behind: no blocks held, nothing counted.
    assert engine.blocks.available() == engine.blocks.num_blocks and engine.stats.steps == 0


def test_a_kernel_that_disagrees_leaves_the_plain_path(model, monkeypatch):
    monkeypatch.setattr(attention, "decode_paged", lambda q, *args: torch.zeros_like(q))
    engine, checks = checked(model)
    assert engine.mode == "plain" and engine.graphs is None
    assert [c.name for c in checks if not c.passed] == ["paged decode kernel against SDPA"]
    assert "relative error 1" in checks[0].detail
    assert checks[-1].passed and "in mode plain" in checks[-1].name


def test_graphs_that_disagree_leave_the_kernel_alone(model, monkeypatch):
    replay = DecodeGraphs.__call__
    monkeypatch.setattr(DecodeGraphs, "__call__", lambda self, b: replay(self, b) * 1.5)
    engine, checks = checked(model)
    assert engine.mode == "kernel"
    assert [c.passed for c in checks] == [True, False, True]


def test_wrong_tokens_in_a_mode_its_own_check_missed_step_it_down(model, monkeypatch):
    # Graphs whose replay is right on the check's rows but wrong on a real step's: only the greedy check sees it.
    monkeypatch.setattr(selfcheck, "_graphs", lambda engine, bound: selfcheck.Check("graphs", True, "planted"))
    replay = DecodeGraphs.__call__
    monkeypatch.setattr(DecodeGraphs, "__call__", lambda self, b: replay(self, b).roll(1, dims=-1))
    engine, checks = checked(model)
    assert engine.mode == "kernel"
    assert [(c.name, c.passed) for c in checks[-2:]] == [
        ("greedy tokens against transformers in mode graphs", False),
        ("greedy tokens against transformers in mode kernel", True),
    ]
    assert "transformers" in checks[-2].detail


def test_an_engine_wrong_even_on_the_plain_path_refuses_to_start(model, monkeypatch):
    engine = Engine(model, kv_tokens=4096, block_size=16, prefill_chunk=256, max_model_len=2048)
    forward = type(engine.forward).__call__
    monkeypatch.setattr(
        type(engine.forward), "__call__", lambda self, b, out=None, stop=None: forward(self, b).roll(1, dims=-1)
    )
    with pytest.raises(selfcheck.EngineRefused, match="disagrees with transformers"):
        selfcheck.start(engine, model, graph_batch=0)
