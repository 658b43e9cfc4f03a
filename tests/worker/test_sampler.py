"""Each sampling parameter on hand-made logits: one row at a time and mixed in one batch."""

from __future__ import annotations

import math

import pytest
import torch

from chatq.worker.sampler import Row, SamplingParams, ThinkingBudget, _truncate, sample


def pick(logits: list[float], output_ids: list[int] | None = None, prompt_ids: list[int] | None = None, **params):
    p = SamplingParams(max_tokens=10, **{"temperature": 0.0, **params})
    t = torch.tensor([logits])
    return sample(t, [Row(p, None, prompt_ids or [], output_ids or [])])[0][0]


BASE = [0.0, 5.0, 4.9, 1.0, 0.5, 0.0, -1.0, 3.0]


def test_greedy_takes_the_largest():
    assert pick(BASE) == 1


def test_greedy_takes_the_first_of_equal_largest_in_a_greedy_and_in_a_mixed_batch():
    tied = [0.0, 5.0, 1.0, 5.0] * 4000  # wide enough for the reduction to run in parallel chunks
    assert pick(tied) == 1
    rows = [Row(SamplingParams(max_tokens=10, temperature=t), None, [], []) for t in (0.0, 1.0)]
    assert sample(torch.tensor([tied, tied]), rows)[0][0] == 1


def test_logit_bias_can_forbid_and_force():
    assert pick(BASE, logit_bias={1: -100.0}) == 2
    assert pick(BASE, logit_bias={6: 100.0}) == 6


def test_logit_bias_beyond_the_vocabulary_is_left_out():
    # On CUDA such an id would be a device assert that ends the worker, not an error of this row.
    assert pick(BASE, logit_bias={10**6: 100.0, -1: 100.0, 6: 100.0}) == 6
    assert pick(BASE, logit_bias={10**6: 100.0}) == 1


def test_min_tokens_blocks_stop_tokens_until_reached():
    assert pick(BASE, stop_token_ids=frozenset({1}), min_tokens=2, output_ids=[3]) == 2
    assert pick(BASE, stop_token_ids=frozenset({1}), min_tokens=1, output_ids=[3]) == 1


def test_penalties_push_repeated_tokens_down():
    assert pick(BASE, output_ids=[1], presence_penalty=0.2) == 2
    assert pick(BASE, output_ids=[2, 2], presence_penalty=0.2) == 1
    assert pick(BASE, output_ids=[1, 1], frequency_penalty=0.06) == 2
    assert pick(BASE, output_ids=[1], frequency_penalty=0.06) == 1  # 5 - 0.06 > 4.9
    assert pick(BASE, prompt_ids=[1], repetition_penalty=1.1) == 2  # 5 / 1.1 < 4.9


def test_truncation_keeps_only_the_allowed_candidates():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        p = SamplingParams(max_tokens=10, temperature=1.0, top_k=2)
        token = sample(torch.tensor([BASE]), [Row(p, gen, [], [])])[0][0]
        assert token in (1, 2)
        p = SamplingParams(max_tokens=10, temperature=1.0, min_p=0.5)
        assert sample(torch.tensor([BASE]), [Row(p, gen, [], [])])[0][0] in (1, 2)
        p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.3)
        assert sample(torch.tensor([BASE]), [Row(p, gen, [], [])])[0][0] == 1


def test_a_top_k_beyond_the_vocabulary_keeps_every_token():
    gen = torch.Generator().manual_seed(0)
    p = SamplingParams(max_tokens=10, temperature=2.0, top_k=1000)
    drawn = {sample(torch.tensor([BASE]), [Row(p, gen, [], [])])[0][0] for _ in range(300)}
    assert len(drawn) == len(BASE)
    # Beside a biased greedy row, which keeps its own answer.
    biased = Row(SamplingParams(max_tokens=10, temperature=0.0, logit_bias={7: 2.5}), None, [], [])
    assert sample(torch.tensor([BASE, BASE]), [biased, Row(p, gen, [], [])])[0][0] == 7


def test_rows_keep_their_own_parameters_in_one_batch():
    logits = torch.tensor([BASE, BASE, BASE])
    rows = [
        Row(SamplingParams(max_tokens=10, temperature=0.0), None, [], []),
        Row(SamplingParams(max_tokens=10, temperature=0.0, logit_bias={7: 10.0}), None, [], []),
        Row(SamplingParams(max_tokens=10, temperature=1.0, top_k=1), torch.Generator().manual_seed(1), [], []),
    ]
    assert sample(logits, rows)[0] == [1, 7, 1]


def test_a_row_that_fails_leaves_every_row_as_it_came():
    logits = torch.tensor([BASE, BASE])
    rows = [
        Row(SamplingParams(max_tokens=10, temperature=0.0, logit_bias={1: -0.06}), None, [], []),
        # A prompt token the vocabulary does not have: nothing the API lets through, a fault to recover from.
        Row(SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.2), None, [10**6], []),
    ]
    with pytest.raises(IndexError):
        sample(logits, rows)
    assert torch.equal(logits, torch.tensor([BASE, BASE]))
    # Sampled again on its own, as the engine does then, the first row is biased once: 5 - 0.06 still beats 4.9.
    assert sample(logits[:1], rows[:1])[0] == [1]


def test_seeded_rows_repeat():
    def draw(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        p = SamplingParams(max_tokens=10, temperature=1.5)
        return [sample(torch.tensor([BASE]), [Row(p, gen, [], [])])[0][0] for _ in range(20)]

    assert draw(5) == draw(5) and draw(5) != draw(6)


def test_logprobs_come_from_the_raw_distribution():
    p = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, logit_bias={6: 100.0})
    tokens, lps = sample(torch.tensor([BASE]), [Row(p, None, [], [])])
    raw = torch.tensor(BASE).log_softmax(-1)
    assert tokens == [6]
    assert lps[0].logprob == pytest.approx(float(raw[6]))
    assert [t for t, _ in lps[0].top] == [1, 2]
    assert math.isclose(lps[0].top[0][1], float(raw[1]), rel_tol=1e-5)


def test_allowed_token_ids_leave_only_those_ids():
    assert pick(BASE, allowed_ids=(3, 6)) == 3
    assert pick(BASE, allowed_ids=(6,), logit_bias={3: 100.0}) == 6


def test_a_bad_words_last_token_is_blocked_only_after_its_prefix():
    assert pick(BASE, bad_words=((1,),)) == 2  # one token: blocked everywhere
    assert pick(BASE, bad_words=((4, 1),), output_ids=[4]) == 2
    assert pick(BASE, bad_words=((4, 1),), output_ids=[3]) == 1
    assert pick(BASE, bad_words=((3, 4, 1),), output_ids=[4]) == 1  # longer than the output so far
    assert pick(BASE, bad_words=((3, 4, 1), (2,)), output_ids=[0, 3, 4]) == 7


def test_logprob_token_ids_list_the_sampled_token_then_the_named_ones():
    raw = torch.tensor(BASE).log_softmax(-1)
    p = SamplingParams(max_tokens=10, temperature=0.0, logprobs=0, logprob_ids=(6, 1, 0, 6), bad_words=((1,),))
    tokens, lps = sample(torch.tensor([BASE]), [Row(p, None, [], [])])
    assert tokens == [2]
    assert [t for t, _ in lps[0].top] == [2, 6, 1, 0]
    # Taken before the filters, as vLLM takes them: the blocked token keeps its logprob.
    assert [v for _, v in lps[0].top] == pytest.approx([float(raw[t]) for t in (2, 6, 1, 0)], rel=1e-5)
    p.logprob_ids = (2, 7)
    assert [t for t, _ in sample(torch.tensor([BASE]), [Row(p, None, [], [])])[1][0].top] == [2, 7]


def test_penalties_follow_a_sequence_step_by_step():
    # The engine keeps one Row history per sequence and appends to its output between steps: each new token must
    # count from the next step on, as if the history were rebuilt from the whole context.
    p = SamplingParams(max_tokens=10, temperature=0.0, frequency_penalty=0.06, repetition_penalty=1.02)
    output: list[int] = []
    row = Row(p, None, [7], output)
    picks = []
    for _ in range(4):
        token = sample(torch.tensor([BASE]), [row])[0][0]
        picks.append(token)
        output.append(token)
        fresh = sample(torch.tensor([BASE]), [Row(p, None, [7], list(output))])[0][0]
        assert sample(torch.tensor([BASE]), [row])[0][0] == fresh
    # 1 (5.0); then 2, as 5/1.02 - 0.06 < 4.9/1.02; then 1 twice, as 4.90 - 0.06 and then 4.90 - 0.12 beat 4.80 - 0.06.
    assert picks == [1, 2, 1, 1]


def test_min_p_cuts_before_top_p_measures():
    # min_p 0.2 drops the 0.05 token; top_p 0.8 of what is left keeps two tokens. Measured on the whole
    # distribution, top_p would have kept three.
    logits = [math.log(p) for p in (0.50, 0.28, 0.17, 0.05)]
    gen = torch.Generator().manual_seed(0)
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.8, min_p=0.2)
    seen = {sample(torch.tensor([logits]), [Row(p, gen, [], [])])[0][0] for _ in range(300)}
    assert seen == {0, 1}


def test_a_row_at_top_p_1_keeps_its_whole_tail_beside_a_row_that_truncates():
    # A long, flat tail, as a real vocabulary has: float32 sums of it from the top reach 1 before its end.
    torch.manual_seed(0)
    logits = torch.randn(2, 50_000) * 3
    logits[:, :4] += 20
    gen = torch.Generator().manual_seed(0)
    rows = [
        Row(SamplingParams(max_tokens=10, temperature=1.0, top_p=1.0), gen, [], []),
        Row(SamplingParams(max_tokens=10, temperature=1.0, top_p=0.5), gen, [], []),
    ]
    kept = _truncate(logits.clone(), rows).isfinite()
    assert kept[0].all()
    assert kept[1].sum() < 4


THINK = ThinkingBudget(3, start=(6, 7), end=(4, 5))  # 6 7 opens a thought, 4 5 closes it


def think(prompt: list[int], steps: int, budget: ThinkingBudget = THINK, temperature: float = 0.0, **extra):
    """The tokens a row of BASE's logits (whose likeliest is 1) takes step by step under a thinking budget, with
    its logprobs; a fresh row each step from some point on, as a job continued on another worker starts one."""
    p = SamplingParams(max_tokens=50, temperature=temperature, thinking=budget, logprobs=0, **extra)
    out: list[int] = []
    generator = None if p.seed is None else torch.Generator().manual_seed(p.seed)
    row = Row(p, generator, prompt, out)
    lps = []
    for step in range(steps):
        if step == steps // 2:
            row = Row(p, generator, prompt, out)  # its history lost, as in a continued job: looked up again
        [token], [lp] = sample(torch.tensor([BASE]), [row])
        out.append(token)
        lps.append(lp.logprob)
    return out, lps


def test_a_thinking_budget_forces_the_end_once_the_thought_has_its_tokens():
    # Opened in the prompt: three tokens of thought, then the end marker's tokens, then free again.
    out, lps = think([0, 6, 7], 8)
    assert out == [1, 1, 1, 4, 5, 1, 1, 1]
    # A forced token's logprob is the model's, as vLLM reports its raw logprobs.
    assert lps[3] == pytest.approx(torch.tensor(BASE).log_softmax(0)[4].item())
    # A prompt token after the start marker counts against the budget; a budget of 0 ends the thought at once.
    assert think([6, 7, 3], 6)[0] == [1, 1, 4, 5, 1, 1]
    assert think([6, 7], 4, ThinkingBudget(0, (6, 7), (4, 5)))[0] == [4, 5, 1, 1]
    # No thought open: nothing is forced, and a thought closed in the prompt stays closed.
    assert think([0], 6)[0] == [1] * 6
    assert think([6, 7, 1, 4, 5], 6)[0] == [1] * 6


def test_a_thought_the_model_opens_itself_gets_the_budget_and_a_later_one_gets_it_again():
    p = SamplingParams(max_tokens=50, temperature=0.0, thinking=THINK)
    out = [0, 6, 7]  # written by the model
    for _ in range(6):
        out.append(sample(torch.tensor([BASE]), [Row(p, None, [0], out)])[0][0])
    assert out[3:] == [1, 1, 1, 4, 5, 1]
    # Only the last thought counts: one closed earlier in the prompt leaves the budget whole for the next.
    assert think([6, 7, 1, 4, 5, 0, 6, 7, 1], 5)[0] == [1, 1, 4, 5, 1]


def test_sampled_rows_are_forced_alike_and_a_seeded_one_repeats():
    out, _ = think([0, 6, 7], 8, temperature=1.0)
    assert out[3:5] == [4, 5] and 6 not in out[:3]
    seeded = [think([0, 6, 7], 10, temperature=1.0, seed=5)[0] for _ in range(2)]
    assert seeded[0] == seeded[1]
