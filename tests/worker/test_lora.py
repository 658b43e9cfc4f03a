"""Adapters in the engine: greedy output under each adapter equal to transformers + peft on the same weights, in
batches that mix adapters with the base model, with adapters swapped in and out of fewer slots than there are."""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path

import pytest
import torch

from chatq.core import lora_format
from chatq.core.adapters import Adapter
from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.lora_format import AdapterInvalid
from chatq.core.render import Renderer
from chatq.core.settings import Settings
from chatq.worker.engine import Engine, Sequence
from chatq.worker.lora import Library
from chatq.worker.model import load_model
from chatq.worker.sampler import SamplingParams
from tests.helpers import make_adapter, model_info, peft_greedy
from tests.worker.test_engine import run

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Count from 1 to 10."]
NEW = 16
RANKS = {"one": 8, "two": 16}


@pytest.fixture(scope="module")
def model():
    return load_model(Settings(device="cpu"))


@pytest.fixture(scope="module")
def spec():
    config = json.loads((Settings().model_dir / "config.json").read_text())
    return lora_format.spec_of(config, max_rank=16, max_loras=4)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Adapter]:
    """Two adapters of different ranks, as the registry knows them."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: Adapter(
            name=name,
            base="m",
            path=str(make_adapter(root / name, rank, seed=i + 1)),
            rank=rank,
            id=uuid.uuid4().hex,
            created=0,
        )
        for i, (name, rank) in enumerate(RANKS.items())
    }


@pytest.fixture(scope="module")
def prompts():
    r = Renderer(model_info())
    return [r.render(ChatCompletionRequest(messages=[{"role": "user", "content": q}])).ids for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(made, prompts) -> dict[str | None, list[list[int]]]:
    """Greedy continuations from transformers, and from transformers + peft under each adapter."""
    return {name: peft_greedy(made[name].path if name else None, prompts, NEW) for name in [None, *made]}


def mixed(library: Library, made: dict[str, Adapter], prompts: list[list[int]]) -> list[Sequence]:
    """Every prompt under the base model and under each adapter, interleaved."""
    seqs = []
    for p, ids in enumerate(prompts):
        for name in [None, *made]:
            lora = library.get(made[name]) if name else None
            params = SamplingParams(max_tokens=NEW, temperature=0)
            seqs.append(Sequence(f"{name}/{p}", ids, params, lora=lora))
    return seqs


@pytest.mark.parametrize(("slots", "kernel"), [(4, True), (1, True), (4, False)])
def test_a_batch_mixing_adapters_and_the_base_model_answers_as_peft_does(
    model, spec, made, prompts, reference, slots, kernel
):
    """Through chatq's CPU kernel and through torch's batched products (a GPU's, or a CPU's without the kernel)."""
    spec = dataclasses.replace(spec, max_loras=slots)
    engine = Engine(model, kv_tokens=4096, block_size=16, prefill_chunk=512, max_model_len=1024, lora=spec)
    assert engine.forward.lora is not None and engine.forward.lora.kernel is not None
    if not kernel:
        engine.forward.lora.kernel = None
    library = Library(spec, torch.float32, capacity=8)
    done = run(engine, mixed(library, made, prompts))
    for name in [None, *made]:
        assert [done[f"{name}/{p}"].output_ids for p in range(len(prompts))] == reference[name], name
    assert reference["one"] != reference[None] and reference["two"] != reference["one"]


def test_an_adapter_is_checked_against_the_model(spec, made, tmp_path):
    config = json.loads(Path(made["two"].path, lora_format.CONFIG).read_text())
    assert lora_format.check(made["two"].path, spec, "m").rank == 16
    with pytest.raises(AdapterInvalid, match="rank 16 is above"):
        lora_format.check(made["two"].path, dataclasses.replace(spec, max_rank=8), "m")
    with pytest.raises(AdapterInvalid, match="cannot be read"):
        lora_format.check(str(tmp_path), spec, "m")
    bad = tmp_path / "dora"
    bad.mkdir()
    (bad / lora_format.CONFIG).write_text(json.dumps(config | {"use_dora": True}))
    with pytest.raises(AdapterInvalid, match="use_dora"):
        lora_format.check(str(bad), spec, "m")


def test_decode_steps_in_fixed_buffers_mix_adapters_as_eager_ones(model, spec, made, prompts, reference):
    """The CUDA graphs' path, its buffers run uncaptured here: padding rows and all, the answers stay peft's."""
    engine = Engine(
        model, kv_tokens=4096, block_size=16, prefill_chunk=512, max_model_len=1024, graph_batch=16, lora=spec
    )
    assert engine.graphs is not None and engine.graphs.variants == (False, True)
    library = Library(spec, torch.float32, capacity=8)
    done = run(engine, mixed(library, made, prompts))
    for name in [None, *made]:
        assert [done[f"{name}/{p}"].output_ids for p in range(len(prompts))] == reference[name], name


def test_an_adapters_prompt_finds_none_of_the_models_cached_blocks(model, spec, made, prompts):
    engine = Engine(model, kv_tokens=4096, block_size=16, prefill_chunk=512, max_model_len=1024, lora=spec)
    library = Library(spec, torch.float32, capacity=8)
    params = SamplingParams(max_tokens=2, temperature=0)
    seqs = [Sequence(f"{i}", prompts[0], params, lora=library.get(made["one"]) if i else None) for i in range(3)]
    for seq in seqs:  # one after the other: each finds what the ones before it left in the cache
        run(engine, [seq])
    assert [s.cached_prompt_tokens for s in seqs] == [0, 0, len(prompts[0]) // 16 * 16]
