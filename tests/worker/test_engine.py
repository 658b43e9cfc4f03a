"""The batched engine against transformers' own generate, on the real default model."""

from __future__ import annotations

import inspect

import pytest
import torch

from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.priority import BATCH_ENGINE_PRIORITY
from chatq.core.render import Renderer
from chatq.core.settings import Settings
from chatq.worker import attention, sampler
from chatq.worker.engine import Engine, Finish, Sequence, repeats
from chatq.worker.grammar import GrammarCompiler, GrammarState
from chatq.worker.graphs import DecodeGraphs
from chatq.worker.model import load_model
from chatq.worker.sampler import SamplingParams
from tests.helpers import model_info

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Count from 1 to 10.",
    "Tell me a joke about cats and dogs, please.",
    "Why is the sky blue?",
]
NEW = 24


@pytest.fixture(scope="module")
def model():
    return load_model(Settings(device="cpu"))


def test_the_default_model_runs_on_chatqs_cpu_kernels(model):
    forward = Engine(model, kv_tokens=256, block_size=16, prefill_chunk=16, max_model_len=128).forward
    assert forward.rows is not None and forward.rows.kernel is not None
    assert forward.fused_norm and forward.fused_rotary


@pytest.fixture(scope="module")
def prompts():
    r = Renderer(model_info())
    return [r.render(ChatCompletionRequest(messages=[{"role": "user", "content": q}])).ids for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(model, prompts):
    """Greedy continuations from transformers' own forward with its own cache, EOS not treated specially."""
    out = []
    # transformers renamed forward's and its output's past_key_values to cache; the old name goes in 5.40.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        for ids in prompts:
            res = model(torch.tensor([ids]), use_cache=True)
            new = [int(res.logits[0, -1].argmax())]
            for _ in range(NEW - 1):
                res = model(torch.tensor([new[-1:]]), **{cache_kw: getattr(res, cache_kw)}, use_cache=True)
                new.append(int(res.logits[0, -1].argmax()))
            out.append(new)
    return out


def run(engine: Engine, seqs: list[Sequence], cancel_after: dict[str, int] | None = None) -> dict[str, Sequence]:
    for s in seqs:
        engine.add(s)
    done = {}
    while engine.has_work():
        for out in engine.step():
            if out.finish:
                done[out.seq.id] = out.seq
            elif cancel_after and len(out.seq.output_ids) == cancel_after.get(out.seq.id):
                engine.cancel(out.seq.id)
    return done


def greedy(i: int, ids: list[int]) -> Sequence:
    return Sequence(str(i), ids, SamplingParams(max_tokens=NEW, temperature=0))


@pytest.mark.parametrize("chunk", [512, 7])
def test_batched_greedy_equals_generate(model, prompts, reference, chunk):
    engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=chunk, max_model_len=8192)
    done = run(engine, [greedy(i, ids) for i, ids in enumerate(prompts)])
    assert [done[str(i)].output_ids for i in range(len(prompts))] == reference
    assert all(done[str(i)].finish is Finish.length for i in range(len(prompts)))
    assert engine.blocks.available() == engine.blocks.num_blocks
    assert engine.forward.rows is None or engine.forward.rows.k, "decode attention on CPU reads the context rows"


@pytest.mark.parametrize("context", ["rows", "gathered"])
def test_sequences_beyond_cache_room_wait_or_are_preempted_and_still_match(
    model, prompts, reference, monkeypatch, context
):
    # The pool is never smaller than one max_model_len sequence, so a small kv_tokens binds only with a small
    # max_model_len. The prompts are 36 to 41 tokens and end 24 tokens later in 4 or 5 blocks, the first block
    # (system prompt) shared: 9 blocks hold two sequences whole. Admission's reserve of a block per running
    # sequence lets a third in; as the three grow, the newest is preempted with tokens already generated, which are
    # recomputed once it is readmitted.
    assert max(map(len, prompts)) + NEW <= 80
    engine = Engine(model, kv_tokens=144, block_size=16, prefill_chunk=16, max_model_len=80)
    assert engine.blocks.num_blocks == 9
    # Context rows are held to the paged cache's size, too small here for even their first capacity.
    rows = engine.forward.rows
    if rows is not None:
        monkeypatch.setattr(rows, "budget", 1 << 30 if context == "rows" else 0)
    preempted_after: list[int] = []  # output tokens each preempted sequence had, to be recomputed
    preempted_lens: list[int] = []  # and its whole length, asked of the prefix cache again when readmitted
    preempt = engine._preempt

    def counting_preempt(seq: Sequence) -> None:
        preempted_after.append(len(seq.output_ids))
        preempted_lens.append(len(seq))
        preempt(seq)

    monkeypatch.setattr(engine, "_preempt", counting_preempt)
    for i, ids in enumerate(prompts):
        engine.add(greedy(i, ids))
    done: dict[str, Sequence] = {}
    most_running = 0
    while engine.has_work():
        for out in engine.step():
            if out.finish:
                done[out.seq.id] = out.seq
        most_running = max(most_running, len(engine.running))
    assert most_running < len(prompts)
    assert any(n > 0 for n in preempted_after)
    # Only the shared first block is ever reused, once per admission: not again at every step a sequence waited.
    assert 0 < engine.blocks.hits <= 16 * (len(prompts) + len(preempted_after))
    # A preempted sequence goes back to its place in the queue, not behind later arrivals: first come, first done.
    assert list(done) == [str(i) for i in range(len(prompts))]
    assert [done[str(i)].output_ids for i in range(len(prompts))] == reference
    assert all(done[str(i)].finish is Finish.length for i in range(len(prompts)))
    assert engine.blocks.available() == engine.blocks.num_blocks
    # What the worker's metrics read: every preemption, each token sampled once (a recomputed one is not sampled
    # again), the prefix cache's hits among the tokens it was asked for.
    stats = engine.stats
    assert stats.preemptions == len(preempted_after)
    assert stats.generation_tokens == NEW * len(prompts)
    assert stats.prefix_hits == engine.blocks.hits
    assert stats.prefix_queries == sum(map(len, prompts)) + sum(preempted_lens)
    assert stats.prefill_tokens <= stats.prefix_queries - stats.prefix_hits


def test_the_least_urgent_sequence_gives_way_when_the_cache_runs_short(model, prompts):
    # 9 blocks; three sequences of 20 + 60 tokens need 15. An urgent one joins after two others started.
    engine = Engine(model, kv_tokens=144, block_size=16, prefill_chunk=64, max_model_len=128)
    preempted: list[str] = []
    preempt = engine._preempt

    def recording_preempt(seq: Sequence) -> None:
        preempted.append(seq.id)
        preempt(seq)

    engine._preempt = recording_preempt  # type: ignore[method-assign]

    def seq(name: str, i: int, priority: int) -> Sequence:
        return Sequence(name, prompts[i][-20:], SamplingParams(max_tokens=60, temperature=0), priority=priority)

    engine.add(seq("low1", 0, 5))
    engine.add(seq("low2", 1, 5))
    engine.step()
    engine.add(seq("urgent", 2, -4))
    finished: list[str] = []
    while engine.has_work():
        finished += [out.seq.id for out in engine.step() if out.finish]
    assert preempted and "urgent" not in preempted
    assert finished.index("urgent") < finished.index("low2")
    assert engine.blocks.available() == engine.blocks.num_blocks


def test_late_joiners_do_not_change_earlier_sequences(model, prompts, reference):
    engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=16, max_model_len=8192)
    engine.add(greedy(0, prompts[0]))
    done = {}
    step = 0
    while engine.has_work() or step < len(prompts):
        step += 1
        if step < len(prompts):
            engine.add(greedy(step, prompts[step]))
        for out in engine.step():
            if out.finish:
                done[out.seq.id] = out.seq.output_ids
    assert [done[str(i)] for i in range(len(prompts))] == reference


def test_a_long_prompt_joining_does_not_stall_running_streams(model, prompts, reference):
    engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=16, max_model_len=8192)
    engine.add(greedy(0, prompts[0]))
    while not engine.running or len(engine.running[0].output_ids) < 2:
        engine.step()
    long_prompt = (prompts[1] * 8)[:200][::-1]  # reversed: no prompt block in common with the running one
    engine.add(Sequence("long", long_prompt, SamplingParams(max_tokens=2, temperature=0)))
    steps_to_first = 0
    while True:
        steps_to_first += 1
        outputs = {o.seq.id: o for o in engine.step()}
        assert outputs["0"].token is not None  # the running stream got its token this step too
        if "long" in outputs:
            break
    assert steps_to_first == 200 // 16 + 1  # the prompt went in 16 tokens a step
    done = run(engine, [])
    assert done["0"].output_ids == reference[0]


def line(i: int, ids: list[int]) -> Sequence:
    """A batch line's sequence (its request's priority raised past BATCH_ENGINE_PRIORITY by the batch runner)."""
    return Sequence(f"line{i}", ids, SamplingParams(max_tokens=NEW, temperature=0), priority=BATCH_ENGINE_PRIORITY)


class SetAfter:
    """An event that reads as set from its `n`+1-th look on: a request arriving while a pass is part way."""

    def __init__(self, n: int):
        self.n, self.looks = n, 0

    def is_set(self) -> bool:
        self.looks += 1
        return self.looks > self.n


def test_a_step_of_batch_lines_alone_stops_for_another_request_and_loses_nothing(model, prompts, reference):
    engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=512, max_model_len=8192)
    for i in range(3):
        engine.add(line(i, prompts[i]))
    tokens = {o.seq.id: [o.token] for o in engine.step()}  # their prompts' pass, then two decode steps
    for _ in range(2):
        for o in engine.step():
            tokens[o.seq.id].append(o.token)
    half = len(engine.forward.layers) // 2
    engine.urgent = SetAfter(half)  # type: ignore[assignment]
    assert engine.step() == []  # given up after half its layers had written their keys and values
    assert engine.urgent.looks == half + 1 and engine.stats.interrupted == 1  # type: ignore[attr-defined]
    # The request that stopped it joins the next step, which is not stopped: it holds more than batch lines.
    engine.add(greedy(3, prompts[3]))
    engine.urgent = SetAfter(0)  # type: ignore[assignment]
    while engine.has_work():
        for o in engine.step():
            if o.token is not None:
                tokens.setdefault(o.seq.id, []).append(o.token)
    assert engine.stats.interrupted == 1
    assert [tokens[f"line{i}"] for i in range(3)] == reference[:3]
    assert tokens["3"] == reference[3]
    assert engine.blocks.available() == engine.blocks.num_blocks


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_batch_lines_sit_out_the_step_of_another_prompt_on_cpu(model, prompts, reference, device):
    engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=512, max_model_len=8192)
    engine.lines_yield = device == "cpu"  # as an engine on a GPU sets it
    for i in range(2):
        engine.add(line(i, prompts[i]))
    engine.step()
    engine.add(greedy(2, prompts[2]))
    fed = {o.seq.id for o in engine.step()}
    assert fed == ({"2"} if device == "cpu" else {"line0", "line1", "2"})
    done = run(engine, [])
    assert [done[f"line{i}"].output_ids for i in range(2)] + [done["2"].output_ids] == reference[:3]
    assert engine.stats.prefill_tokens == sum(map(len, prompts[:3])) - engine.stats.prefix_hits


def test_cancel_takes_effect_at_the_next_step(model, prompts):
    engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=512, max_model_len=8192)
    seqs = [greedy(i, ids) for i, ids in enumerate(prompts[:3])]
    done = run(engine, seqs, cancel_after={"1": 3})
    assert done["1"].finish is Finish.cancelled and len(done["1"].output_ids) == 3
    assert len(done["0"].output_ids) == NEW and len(done["2"].output_ids) == NEW
    assert engine.blocks.available() == engine.blocks.num_blocks


def test_a_sequence_whose_sampling_fails_ends_alone(model, prompts, reference, monkeypatch):
    real = sampler._shape

    def shape(logits, rows):  # a fault in one row's shaping, whatever would cause it
        if any(r.params.logit_bias == {7: 1.0} for r in rows):
            raise IndexError("a bad row")
        real(logits, rows)

    monkeypatch.setattr(sampler, "_shape", shape)
    engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=512, max_model_len=8192)
    bad = Sequence("bad", prompts[1], SamplingParams(max_tokens=NEW, temperature=0, logit_bias={7: 1.0}))
    done = run(engine, [greedy(0, prompts[0]), bad, greedy(2, prompts[2])])
    assert done["bad"].finish is Finish.error and done["bad"].error.startswith("sampling failed")
    assert done["bad"].output_ids == []
    assert done["0"].output_ids == reference[0] and done["2"].output_ids == reference[2]
    assert engine.blocks.available() == engine.blocks.num_blocks


def test_a_sequence_whose_grammar_fails_ends_alone(model, prompts, reference):
    compiler = GrammarCompiler(model_info().tokenizer, model.config.vocab_size, eos_token_ids=[2])
    state = GrammarState(compiler.json_object())
    calls = 0

    def accept(token: int) -> bool:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("a grammar engine fault")
        return True

    state.accept = accept  # type: ignore[method-assign]
    engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=512, max_model_len=8192)
    bad = Sequence("bad", prompts[1], SamplingParams(max_tokens=NEW, temperature=0), grammar=state)
    done = run(engine, [greedy(0, prompts[0]), bad, greedy(2, prompts[2])])
    assert done["bad"].finish is Finish.error and done["bad"].error == "generation failed (RuntimeError)"
    assert len(done["bad"].output_ids) == 2
    assert done["0"].output_ids == reference[0] and done["2"].output_ids == reference[2]
    assert engine.blocks.available() == engine.blocks.num_blocks


def test_a_forward_pass_failing_with_prompt_chunks_fails_only_those(model, prompts, reference, monkeypatch):
    engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=512, max_model_len=8192)
    forward = type(engine.forward).__call__
    failures = 0

    def flaky(self, batch, out=None, stop=None):  # out of memory, say, on the newcomer's prompt chunk
        nonlocal failures
        if batch.prefills and batch.num_decode:
            failures += 1
            raise torch.OutOfMemoryError("no room for the chunk")
        return forward(self, batch, out, stop)

    monkeypatch.setattr(type(engine.forward), "__call__", flaky)
    engine.add(greedy(0, prompts[0]))
    engine.step()  # its prefill, alone
    engine.add(Sequence("late", prompts[1], SamplingParams(max_tokens=NEW, temperature=0)))
    done = run(engine, [greedy(2, prompts[2])])
    assert failures == 1
    assert done["late"].finish is Finish.error and done["late"].error == "generation failed (OutOfMemoryError)"
    assert done["2"].finish is Finish.error  # it joined in the same step
    assert done["0"].output_ids == reference[0]
    assert engine.blocks.available() == engine.blocks.num_blocks


def test_a_fault_outside_any_sequence_fails_them_all_and_the_engine_goes_on(model, prompts, reference, monkeypatch):
    engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=512, max_model_len=8192)
    engine.add(greedy(0, prompts[0]))
    engine.step()
    schedule = engine._schedule
    monkeypatch.setattr(engine, "_schedule", lambda: 1 / 0)
    engine.add(greedy(1, prompts[1]))
    outputs = engine.step()
    assert sorted((o.seq.id, o.finish) for o in outputs) == [("0", Finish.error), ("1", Finish.error)]
    assert not engine.has_work()
    monkeypatch.setattr(engine, "_schedule", schedule)
    done = run(engine, [greedy(2, prompts[2])])
    assert done["2"].output_ids == reference[2]
    assert engine.blocks.available() == engine.blocks.num_blocks


def test_a_prompt_larger_than_the_cache_fails_instead_of_blocking_the_queue(model, prompts, reference):
    engine = Engine(model, kv_tokens=64, block_size=16, prefill_chunk=512, max_model_len=64)
    huge = Sequence("huge", list(prompts[0]) * 3, SamplingParams(max_tokens=4, temperature=0))
    done = run(engine, [huge, Sequence("0", prompts[0], SamplingParams(max_tokens=4, temperature=0))])
    assert done["huge"].finish is Finish.error and "KV cache" in done["huge"].error
    assert done["0"].output_ids == reference[0][:4]


def test_seeded_sampling_does_not_depend_on_the_batch(model, prompts):
    def sampled(batch_with: list[list[int]]) -> list[int]:
        engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=512, max_model_len=8192)
        seqs = [Sequence("x", prompts[0], SamplingParams(max_tokens=12, temperature=1.0, seed=7))]
        seqs += [
            Sequence(f"o{i}", ids, SamplingParams(max_tokens=12, temperature=1.0)) for i, ids in enumerate(batch_with)
        ]
        return run(engine, seqs)["x"].output_ids

    assert sampled([]) == sampled(prompts[1:4])


FILTERED = {"temperature": 1.0, "seed": 7, "allowed_ids": tuple(range(200, 3000)), "bad_words": ((260, 261), (300,))}


@pytest.mark.parametrize(
    "params",
    [{"temperature": 0}, {"temperature": 1.0, "seed": 7}, FILTERED],
    ids=["greedy", "seeded", "filtered"],
)
def test_a_sequence_taken_up_with_its_output_so_far_continues_as_it_would_have(model, prompts, params):
    # As a worker continues a job from its log: prompt and output prefilled again, then sampling goes on.
    def engine() -> Engine:
        return Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=512, max_model_len=8192)

    whole = run(engine(), [Sequence("x", prompts[1], SamplingParams(max_tokens=30, **params))])["x"].output_ids
    for cut in (1, 13):
        again = Sequence("x", prompts[1], SamplingParams(max_tokens=30, **params), output_ids=whole[:cut])
        assert run(engine(), [again])["x"].output_ids == whole


def test_a_repeated_pattern_ends_a_sequence_as_vllm_detects_it():
    assert repeats([5, 1, 2, 1, 2, 1, 2], 1, 2, 3)
    assert not repeats([5, 1, 2, 1, 2, 1, 2], 1, 2, 4)
    assert not repeats([1, 2, 1, 2, 1, 2], 1, 1, 3)  # a pattern of 2 is beyond the largest size
    assert not repeats([7, 7, 7, 7], 2, 2, 3)  # four tokens are too few for a pattern of 2 three times
    assert repeats([7, 7, 7], 0, 1, 3)
    for min_tokens, at in ((0, 5), (7, 6)):  # from min_tokens on
        seq = Sequence("r", [1], SamplingParams(max_tokens=10, repetition=(1, 2, 3), min_tokens=min_tokens))
        ends = [seq.take(t, 100) for t in [1, 2, 1, 2, 1, 2, 1][: at + 1]]
        assert ends == [None] * at + [Finish.repetition]


def test_a_sequence_counts_the_prompt_the_prefix_cache_served_within_its_salt_only(model, prompts, reference):
    engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=512, max_model_len=8192)

    def served(name: str, salt: bytes) -> Sequence:
        seq = Sequence(name, prompts[1], SamplingParams(max_tokens=NEW, temperature=0), cache_salt=salt)
        return run(engine, [seq])[name]

    first = served("a", b"key a")
    assert first.cached_prompt_tokens == 0 and first.output_ids == reference[1]
    again = served("b", b"key a")
    assert again.cached_prompt_tokens == (len(prompts[1]) - 1) // 16 * 16 > 0
    assert again.output_ids == reference[1]
    assert served("c", b"key b").cached_prompt_tokens == 0
    assert served("d", b"").cached_prompt_tokens == 0


def test_stop_token_ends_a_sequence(model, prompts, reference):
    stop_at = reference[0][4]
    engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=512, max_model_len=8192)
    seq = Sequence("s", prompts[0], SamplingParams(max_tokens=NEW, temperature=0, stop_token_ids=frozenset([stop_at])))
    done = run(engine, [seq])
    assert done["s"].finish is Finish.stop
    assert done["s"].output_ids == reference[0][: reference[0].index(stop_at) + 1]


def test_shared_prompt_prefixes_are_computed_once(model, prompts, reference):
    engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=512, max_model_len=8192)
    first = run(engine, [greedy(i, ids) for i, ids in enumerate(prompts)])
    # Admitted in one step, the first five had nothing to share yet; now every full prompt block is registered.
    again = run(engine, [greedy(i, ids) for i, ids in enumerate(prompts)])
    assert engine.blocks.hits == sum((len(p) - 1) // 16 * 16 for p in prompts)
    late = run(engine, [greedy(9, prompts[0][:20] + prompts[1][20:])])
    assert engine.blocks.hits > sum((len(p) - 1) // 16 * 16 for p in prompts)  # the shared system prompt
    assert late["9"].output_ids
    assert [again[str(i)].output_ids for i in range(len(prompts))] == reference
    assert [first[str(i)].output_ids for i in range(len(prompts))] == reference
    assert engine.blocks.available() == engine.blocks.num_blocks


def test_decode_steps_through_fixed_size_buffers_equal_eager(model, prompts, reference):
    # Buckets 1, 2, 4: five sequences run eagerly; as two of them finish early, four and then three (padded to
    # four, the spare row pointed away from the live sequence it held the step before) replay the buffers.
    engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=512, max_model_len=8192, graph_batch=4)
    lengths = [NEW, 8, 12, NEW, NEW]
    seqs = [
        Sequence(str(i), ids, SamplingParams(max_tokens=n, temperature=0))
        for i, (ids, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    done = run(engine, seqs)
    assert engine.graphs is not None and engine.graphs.sizes == [1, 2, 4]
    assert [done[str(i)].output_ids for i in range(len(prompts))] == [
        r[:n] for r, n in zip(reference, lengths, strict=True)
    ]
    assert engine.blocks.available() == engine.blocks.num_blocks


def test_a_failed_graph_capture_leaves_the_engine_eager(model, prompts, reference, monkeypatch):
    def capture_fails(*_args, **_kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr("chatq.worker.engine.DecodeGraphs", capture_fails)
    engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=512, max_model_len=8192, graph_batch=4)
    assert engine.graphs is None
    done = run(engine, [greedy(0, prompts[0])])
    assert done["0"].output_ids == reference[0]


def test_decode_through_the_cuda_kernel_equals_generate(model, prompts, reference):
    # The CUDA decode path (the Triton kernel reading the block tables, through the graph buffers), here in Triton's
    # interpreter: five sequences, then four and three as two finish early.
    engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=512, max_model_len=8192, graph_batch=4)
    engine.forward.paged = True
    lengths = [8, 3, 5, 8, 8]
    seqs = [
        Sequence(str(i), ids, SamplingParams(max_tokens=n, temperature=0))
        for i, (ids, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    done = run(engine, seqs)
    assert [done[str(i)].output_ids for i in range(len(prompts))] == [
        r[:n] for r, n in zip(reference, lengths, strict=True)
    ]


@pytest.mark.parametrize("failing", ["graphs", "kernel"])
def test_a_fast_path_failing_at_run_time_is_turned_off_and_the_step_runs_again(model, prompts, reference, failing):
    # The CUDA path's code in Triton's interpreter and the uncaptured graph buffers; one of them raises from the third
    # decode step on, as a kernel that errs on a shape its start check did not try.
    engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=512, max_model_len=8192, graph_batch=4)
    engine.forward.paged = True
    calls = 0

    def failing_after_two(real):
        def call(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls > 2:
                raise RuntimeError("Triton Error [CUDA]: an error the start check did not meet")
            return real(*args, **kwargs)

        return call

    if failing == "graphs":
        patched = failing_after_two(DecodeGraphs.__call__)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(DecodeGraphs, "__call__", patched)
            done = run(engine, [greedy(i, ids) for i, ids in enumerate(prompts[:3])])
        assert engine.mode == "kernel"
    else:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(attention, "decode_paged", failing_after_two(attention.decode_paged))
            done = run(engine, [greedy(i, ids) for i, ids in enumerate(prompts[:3])])
        assert engine.mode == "plain" and engine.graphs is None
    assert [done[str(i)].output_ids for i in range(3)] == reference[:3]


def expected_prompt_logprobs(model, ids: list[int], k: int) -> list[tuple[float, int, list[int]]]:
    """transformers' log_softmax over the prompt: each token's logprob (but the first's), its rank, the k likeliest."""
    with torch.inference_mode():
        lp = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(dim=-1)
    out = []
    for p, token in enumerate(ids[1:]):
        out.append((float(lp[p, token]), int((lp[p] >= lp[p, token]).sum()), lp[p].topk(k).indices.tolist()))
    return out


@pytest.mark.parametrize("chunk", [512, 7])
def test_prompt_logprobs_equal_transformers_log_softmax(model, prompts, chunk):
    engine = Engine(model, kv_tokens=8192, block_size=16, prefill_chunk=chunk, max_model_len=8192)
    run(engine, [greedy(9, prompts[0])])  # its blocks are in the prefix cache now, which scoring must not skip
    seqs = [
        Sequence(str(i), ids, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))
        for i, ids in enumerate(prompts[:3])
    ]
    done = run(engine, seqs)
    assert engine.blocks.hits == 0
    done |= run(engine, [greedy(8, prompts[3])])
    for i, ids in enumerate(prompts[:3]):
        got = done[str(i)].prompt_logprobs
        want = expected_prompt_logprobs(model, ids, 3)
        assert len(got) == len(ids) - 1
        for entry, (logprob, rank, top) in zip(got, want, strict=True):
            assert entry.logprob == pytest.approx(logprob, abs=1e-4)
            assert entry.rank == rank
            assert [t for t, _ in entry.top] == top
    assert done["8"].prompt_logprobs == []


def test_a_preempted_sequence_scores_its_prompt_once(model, prompts):
    engine = Engine(model, kv_tokens=160, block_size=16, prefill_chunk=16, max_model_len=80)
    seqs = [
        Sequence(str(i), ids, SamplingParams(max_tokens=30, temperature=0, prompt_logprobs=0))
        for i, ids in enumerate(prompts[:3])
    ]
    done = run(engine, seqs)
    assert engine.stats.preemptions
    for i, ids in enumerate(prompts[:3]):
        want = expected_prompt_logprobs(model, ids, 1)
        assert [e.logprob for e in done[str(i)].prompt_logprobs] == pytest.approx([w[0] for w in want], abs=1e-4)
