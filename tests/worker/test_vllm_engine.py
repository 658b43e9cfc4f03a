"""chatq.worker.vllm_engine on vLLM's own engine (its CPU build) and the default model: what the engine loop and the
job's run get from it. It runs in .venv-vllm, where tests/test_vllm_backend.py runs this module."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: tests/test_vllm_backend.py runs this in .venv-vllm")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from chatq.core.model_info import ModelInfo  # noqa: E402
from chatq.core.settings import Settings  # noqa: E402
from chatq.worker.build import vllm_args  # noqa: E402
from chatq.worker.engine import Finish, Output, Sequence  # noqa: E402
from chatq.worker.grammar import Grammar, GrammarCompiler  # noqa: E402
from chatq.worker.sampler import SamplingParams, ThinkingBudget  # noqa: E402
from chatq.worker.vllm_engine import VllmEngine, token_logprob  # noqa: E402

# The default model has no single-token thought markers, which vLLM's reasoning parsers need: a reasoning config names
# them, for thinking budgets.
MARKERS = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}
SETTINGS = Settings(
    kv_cache_tokens=16384, worker_concurrency=8, vllm_args={"enforce_eager": True, "reasoning_config": MARKERS}
)
MODEL = ModelInfo.read(SETTINGS.model_name, SETTINGS.model_dir)
EOS = frozenset(MODEL.eos_token_ids)
CHAT = (
    "<|im_start|>user\nTell me a long story about a lighthouse keeper and the sea.<|im_end|>\n<|im_start|>assistant\n"
)
PROMPT = MODEL.tokenizer.encode(CHAT, add_special_tokens=False).ids
# A prompt the model answers by repeating itself: what speculative decoding's n-grams guess right.
LOOPING = PROMPT[:3]


def build(settings: Settings = SETTINGS) -> VllmEngine:
    args = vllm_args(settings, settings.model_dir, MODEL)
    return VllmEngine(args, eos_token_ids=MODEL.eos_token_ids, max_model_len=MODEL.max_model_len)


@pytest.fixture(scope="module")
def engine() -> VllmEngine:
    return build()


def greedy(
    seq_id: str, max_tokens: int, prompt: list[int] = PROMPT, format: Grammar | None = None, **params
) -> Sequence:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return Sequence(seq_id, list(prompt), sampling, format=format)


def run(engine: VllmEngine, *seqs: Sequence) -> dict[str, list[Output]]:
    """Each sequence's outputs, stepping until the engine has no work."""
    for seq in seqs:
        engine.add(seq)
    outputs = defaultdict(list)
    while engine.has_work():
        for out in engine.step():
            outputs[out.seq.id].append(out)
    return outputs


def test_greedy_tokens_are_transformers_and_each_output_is_one_token(engine):
    seq = greedy("g/0", 12, stop_token_ids=EOS)
    outputs = run(engine, seq)["g/0"]
    assert [o.token for o in outputs] == seq.output_ids and len(seq.output_ids) == 12
    assert [o.finish for o in outputs] == [None] * 11 + [Finish.length] and seq.finish is Finish.length
    model = AutoModelForCausalLM.from_pretrained(SETTINGS.model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT + seq.output_ids])).logits[0, len(PROMPT) - 1 : -1]
    assert logits.argmax(-1).tolist() == seq.output_ids


def test_logprobs_are_the_sampled_tokens_and_the_k_most_likely(engine):
    seq = greedy("l/0", 4, logprobs=2)
    outputs = run(engine, seq)["l/0"]
    for out in outputs:
        assert out.logprob is not None and len(out.logprob.top) == 2
        (first, best), (_, second) = out.logprob.top
        assert first == out.token and out.logprob.logprob == best >= second
    assert math.exp(outputs[0].logprob.logprob) <= 1.0


def test_a_logprob_leaves_out_a_sampled_token_below_the_k_most_likely_and_floors_minus_infinity():
    entries = {
        7: SimpleNamespace(logprob=-5.0, rank=9),
        3: SimpleNamespace(logprob=-0.1, rank=1),
        4: SimpleNamespace(logprob=float("-inf"), rank=2),
    }
    assert token_logprob(7, entries, 2).logprob == -5.0
    assert token_logprob(7, entries, 2).top == [(3, -0.1), (4, -9999.0)]
    assert token_logprob(3, entries, 0).top == []


def test_a_stop_token_ends_the_sequence_with_it_and_min_tokens_holds_it_off(engine):
    full = greedy("s/0", 8)
    run(engine, full)
    stop = full.output_ids[3]
    stopped = greedy("s/1", 8, stop_token_ids=frozenset({stop}))
    held = greedy("s/2", 8, stop_token_ids=frozenset({stop}), min_tokens=5)
    outputs = run(engine, stopped, held)
    assert stopped.output_ids == full.output_ids[:4] and outputs["s/1"][-1].finish is Finish.stop
    assert len(held.output_ids) > 5 and stop not in held.output_ids[:5]


def test_a_job_continued_from_its_output_goes_on_where_it_stopped(engine):
    full = greedy("r/0", 16)
    run(engine, full)
    resumed = greedy("r/1", 16)
    resumed.output_ids = full.output_ids[:6]  # as a job's replay of its log leaves it
    outputs = run(engine, resumed)["r/1"]
    assert [o.token for o in outputs] == full.output_ids[6:] and resumed.output_ids == full.output_ids
    assert outputs[-1].finish is Finish.length


def test_a_grammar_holds_the_answer_and_its_end_ends_it_even_ignoring_eos(engine):
    compiler = GrammarCompiler(MODEL.tokenizer, MODEL.vocab_size, eos_token_ids=MODEL.eos_token_ids)
    schema = {"type": "object", "properties": {"keeper": {"type": "boolean"}}, "required": ["keeper"]}
    choice = greedy("c/0", 20, format=compiler.choice(["yes", "no"]))  # no stop ids: the request ignores EOS
    structured = greedy("c/1", 40, stop_token_ids=EOS, format=compiler.json_schema(schema))
    outputs = run(engine, choice, structured)
    for seq in (choice, structured):
        assert outputs[seq.id][-1].finish is Finish.stop and seq.output_ids[-1] in EOS
    assert MODEL.tokenizer.decode(choice.output_ids[:-1]) in ("yes", "no")
    assert json.loads(MODEL.tokenizer.decode(structured.output_ids[:-1]))["keeper"] in (True, False)


def test_a_cancel_ends_the_sequence_and_vllm_holds_it_no_more(engine):
    seq = greedy("x/0", 500)
    engine.add(seq)
    while len(seq.output_ids) < 2:
        engine.step()
    engine.cancel("x/0")
    (out,) = engine.step()
    assert (out.seq, out.token, out.finish) == (seq, None, Finish.cancelled) and seq.finish is Finish.cancelled
    assert not engine.has_work() and engine.engine.get_num_unfinished_requests() == 0
    # Cancelled in the step that would add it: it never reaches vLLM.
    late = greedy("x/1", 500)
    engine.add(late)
    engine.cancel("x/1")
    assert [(o.seq, o.token, o.finish) for o in engine.step()] == [(late, None, Finish.cancelled)]
    assert engine.engine.get_num_unfinished_requests() == 0


def test_a_request_vllm_refuses_fails_alone(engine):
    too_long = greedy("e/0", 4, prompt=[PROMPT[1]] * (MODEL.max_model_len + 1))
    fine = greedy("e/1", 3)
    outputs = run(engine, too_long, fine)
    assert [(o.token, o.finish) for o in outputs["e/0"]] == [(None, Finish.error)]
    assert too_long.error is not None and too_long.error.startswith("vLLM refused the request")
    assert len(fine.output_ids) == 3 and fine.finish is Finish.length


def test_the_stats_count_the_steps_tokens_and_cache(engine):
    before = (engine.stats.steps, engine.stats.generation_tokens, engine.stats.prefix_queries)
    seq = greedy("t/0", 5)
    run(engine, seq)
    steps, tokens, queries = engine.stats.steps, engine.stats.generation_tokens, engine.stats.prefix_queries
    assert tokens - before[1] == 5 and steps - before[0] >= 5 and queries - before[2] >= len(PROMPT)
    held = engine.occupancy()
    assert held.num_blocks > 0 and (held.running, held.used_blocks) == (0, 0)


def test_speculative_decoding_gives_the_same_tokens_several_a_step_one_output_each(engine):
    plain = greedy("p/0", 40, prompt=LOOPING)
    run(engine, plain)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    spec = build(SETTINGS.model_copy(update={"vllm_args": SETTINGS.vllm_args | {"speculative_config": ngram}}))
    seq = greedy("p/0", 40, prompt=LOOPING)
    spec.add(seq)
    per_step = []
    while spec.has_work():
        outputs = spec.step()
        per_step.append(len(outputs))
        assert all(o.token is not None for o in outputs)
    assert seq.output_ids == plain.output_ids and max(per_step) > 1


def test_prompt_logprobs_are_transformers_log_softmax_over_the_prompt(engine):
    seq = greedy("s/0", 2, prompt_logprobs=2)
    run(engine, seq)
    model = AutoModelForCausalLM.from_pretrained(SETTINGS.model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        lp = model(torch.tensor([PROMPT])).logits[0, :-1].float().log_softmax(dim=-1)
    assert len(seq.prompt_logprobs) == len(PROMPT) - 1
    for p, entry in enumerate(seq.prompt_logprobs):
        token = PROMPT[p + 1]
        assert entry.logprob == pytest.approx(float(lp[p, token]), abs=1e-4)
        assert entry.rank == int((lp[p] >= lp[p, token]).sum())
        assert [t for t, _ in entry.top] == lp[p].topk(2).indices.tolist()


def test_named_logprob_ids_are_reported_at_each_place_beside_the_sampled_one(engine):
    named = (PROMPT[1], PROMPT[2], 0)
    plain, seq = greedy("n/0", 4, logprobs=3), greedy("n/1", 4, logprobs=3, logprob_ids=named)
    outputs = run(engine, plain, seq)
    assert seq.output_ids == plain.output_ids
    for got, full in zip(outputs["n/1"], outputs["n/0"], strict=True):
        assert got.logprob is not None and full.logprob is not None
        # As chatq's sampler lists them: the sampled token, then the named ones.
        assert [t for t, _ in got.logprob.top] == [got.token, *named]
        assert got.logprob.logprob == pytest.approx(full.logprob.logprob, abs=1e-4)


def test_allowed_ids_and_bad_words_hold_the_answer_as_chatqs_sampler_does(engine):
    free = greedy("f/0", 6)
    run(engine, free)
    allowed = (free.output_ids[1], free.output_ids[2], PROMPT[4])
    held = greedy("f/1", 6, allowed_ids=allowed)
    banned = greedy("f/2", 6, bad_words=((free.output_ids[0],),))
    run(engine, held, banned)
    assert set(held.output_ids) <= set(allowed) and len(held.output_ids) == 6
    assert free.output_ids[0] not in banned.output_ids


def test_a_thinking_budget_ends_an_open_thought_with_the_end_marker(engine):
    """The budget reaches vLLM, which forces the end marker two tokens past it (vLLM 0.32's engine lets a thought of
    budget b run to b + 2 tokens; chatq's engine ends it at b)."""
    start, end = (tuple(MODEL.tokenizer.encode(tag, add_special_tokens=False).ids) for tag in ("<think>", "</think>"))
    prompt = PROMPT + list(start)
    free = greedy("t/0", 10, prompt=prompt)
    budgeted = greedy("t/1", 10, prompt=prompt, thinking=ThinkingBudget(3, start, end))
    run(engine, free, budgeted)
    assert tuple(free.output_ids[5:8]) != end
    assert budgeted.output_ids[:5] == free.output_ids[:5] and tuple(budgeted.output_ids[5:8]) == end
