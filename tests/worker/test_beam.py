"""Beam search in the engine against transformers' generate(num_beams=...), on the real default model."""

from __future__ import annotations

import pytest
import torch

from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.render import Renderer
from chatq.core.settings import Settings
from chatq.worker.beam import BeamGroup, BeamSearch
from chatq.worker.engine import Engine, Finish, Sequence
from chatq.worker.model import load_model
from chatq.worker.sampler import SamplingParams
from tests.helpers import model_info

EOS = frozenset(model_info().eos_token_ids)


@pytest.fixture(scope="module")
def model():
    return load_model(Settings(device="cpu"))


@pytest.fixture(scope="module")
def prompt():
    r = Renderer(model_info())
    return r.render(ChatCompletionRequest(messages=[{"role": "user", "content": "Name a colour."}])).ids


def transformers_beams(model, prompt, width, new, length_penalty=1.0, early_stopping=False) -> list[list[int]]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width,
            num_return_sequences=width,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            do_sample=False,
            repetition_penalty=1.0,  # plain beam search, whatever the model's generation config holds
            max_new_tokens=new,
            eos_token_id=sorted(EOS),
            pad_token_id=-1,
        )
    return [[t for t in row[len(prompt) :].tolist() if t != -1] for row in out]


def engine_beams(model, prompt, width, new, length_penalty=1.0, early_stopping=False, **engine_kw) -> list[Sequence]:
    kw = dict(kv_tokens=2048, block_size=16, prefill_chunk=64, max_model_len=512) | engine_kw
    engine = Engine(model, **kw)
    search = BeamSearch(
        width, length_penalty=length_penalty, early_stopping=early_stopping, end_ids=EOS, max_tokens=new
    )
    group = BeamGroup(search)
    for i in range(width):
        seq = Sequence(f"b/{i}", prompt, SamplingParams(max_tokens=new, stop_token_ids=EOS), beams=group)
        group.seqs.append(seq)
        engine.add(seq)
    done = {}
    while engine.has_work():
        for out in engine.step():
            assert out.finish is not None and out.token is None, "a beam search answers only at its end"
            done[out.seq.id] = out.seq
    assert engine.blocks.available() == engine.blocks.num_blocks, "every block is handed back"
    return [done[f"b/{i}"] for i in range(width)]


@pytest.mark.parametrize(
    ("width", "new", "length_penalty", "early_stopping"),
    [(3, 16, 1.0, False), (2, 16, 0.5, True), (2, 16, 2.0, "never")],
)
def test_beams_equal_transformers_token_for_token(model, prompt, width, new, length_penalty, early_stopping):
    expected = transformers_beams(model, prompt, width, new, length_penalty, early_stopping)
    got = engine_beams(model, prompt, width, new, length_penalty, early_stopping)
    assert [s.output_ids for s in got] == expected
    for s in got:
        ended = s.output_ids[-1] in EOS
        assert s.finish is (Finish.stop if ended else Finish.length)
