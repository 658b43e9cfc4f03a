"""A job's events as the worker builds them, fed by hand-made engine outputs (no model)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.completion_request import CompletionRequest
from chatq.core.job import EventKind, Job, JobStatus
from chatq.core.settings import Settings
from chatq.worker.detokenize import Decoder
from chatq.worker.engine import Finish, Output
from chatq.worker.grammar import GrammarCompiler
from chatq.worker.jobrun import JobRun
from chatq.worker.sampler import TokenLogprob
from tests.helpers import model_info


@pytest.fixture(scope="module")
def decoder() -> Decoder:
    return Decoder(Tokenizer.from_file(str(Settings().model_dir / "tokenizer.json")))


def job(**fields) -> Job:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)
    return Job(id="chatcmpl-test", model="m", request=request, prompt_ids=[1, 2, 3])


def ids(decoder: Decoder, text: str) -> list[int]:
    return decoder.tokenizer.encode(text, add_special_tokens=False).ids


def test_generation_error_mid_stream_sends_an_error_then_done(decoder):
    run = JobRun(job(stream=True), model_info(100, (2,)), decoder, settings=Settings())
    events = run.start()
    choice = run.choices[0]
    for t in ids(decoder, "Hello there"):
        choice.seq.output_ids.append(t)
        events += run.on_output(choice, Output(choice.seq, t, None))[0]
    choice.seq.error = "generation failed: device lost"
    events += run.on_output(choice, Output(choice.seq, None, Finish.error))[0]
    assert run.finished
    closing, end = run.end()
    events += closing
    assert [e.event for e in events[-2:]] == [EventKind.error, EventKind.done]
    assert events[-2].data["error"]["message"] == "generation failed: device lost"
    assert events[-2].sse_data().startswith(b'{"error":')
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert end.status is JobStatus.failed and end.error["code"] == 500
    streamed = "".join(e.data["choices"][0]["delta"].get("content", "") for e in events if e.event is EventKind.chunk)
    assert streamed == "Hello there"


def test_each_choice_finishes_once_and_usage_comes_last(decoder):
    run = JobRun(
        job(n=2, temperature=1.0, stream=True, stream_options={"include_usage": True}),
        model_info(100, (2,)),
        decoder,
        settings=Settings(),
    )
    events = run.start()
    for c in run.choices:
        for t in [*ids(decoder, "ok"), 2]:
            c.seq.output_ids.append(t)
            events += run.on_output(c, Output(c.seq, t, Finish.stop if t == 2 else None))[0]
    closing, end = run.end()
    events += closing
    finishes = [
        (e.data["choices"][0]["index"], e.data["choices"][0]["finish_reason"])
        for e in events
        if e.event is EventKind.chunk and e.data["choices"] and e.data["choices"][0]["finish_reason"]
    ]
    assert finishes == [(0, "stop"), (1, "stop")]
    assert events[-2].data["choices"] == [] and events[-2].data["usage"]["completion_tokens"] == 2 * 2
    assert end.status is JobStatus.completed
    assert [c["message"]["content"] for c in end.result["choices"]] == ["ok", "ok"]


def test_running_usage_counts_the_chunks_own_choice(decoder):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    run = JobRun(
        job(n=2, temperature=1.0, stream=True, stream_options=opts), model_info(100, (2,)), decoder, settings=Settings()
    )
    events = run.start()
    for c in run.choices:  # choice 0 ends before choice 1 starts: their counts must not mix
        for t in ids(decoder, " one two"):
            c.seq.output_ids.append(t)
            events += run.on_output(c, Output(c.seq, t, None))[0]
        c.seq.output_ids.append(2)
        events += run.on_output(c, Output(c.seq, 2, Finish.stop))[0]
    events += run.end()[0]
    chunks = [e.data for e in events if e.event is EventKind.chunk]
    for index in (0, 1):
        running = [
            c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c["choices"][0]["index"] == index
        ]
        assert running == [0, 1, 2, 3]  # the role chunk, two tokens, the finish (after the stop token)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_required_tool_calls_leave_content_empty_not_null(decoder):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    _, result = run_text(decoder, text, Settings(), tools=tools, tool_choice="required")
    message = result["choices"][0]["message"]
    assert message["content"] == "" and message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert result["choices"][0]["finish_reason"] == "tool_calls"


def test_legacy_echo_is_the_prompt_as_sent_and_top_logprobs_hold_the_sampled_token(decoder):
    prompt = "Caf\u00e9  au   lait"  # decoding its ids could normalise it; the echo must not
    request = CompletionRequest(prompt=prompt, echo=True, logprobs=1, stream=False)
    run = JobRun(
        Job(id="cmpl-test", model="m", request=request, prompt_ids=ids(decoder, prompt)),
        model_info(100, (2,)),
        decoder,
        settings=Settings(),
    )
    run.start()
    c = run.choices[0]
    sampled, likelier = ids(decoder, " yes")[0], ids(decoder, " no")[0]
    c.seq.prompt_logprobs = [TokenLogprob(-1.0, [(likelier, -0.5)], 2) for _ in c.seq.prompt_ids[1:]]
    c.seq.output_ids.append(sampled)
    run.on_output(c, Output(c.seq, sampled, Finish.length, TokenLogprob(-2.0, [(likelier, -0.5)])))
    [choice] = run.end()[1].result["choices"]
    assert choice["text"] == prompt + " yes"
    # The prompt's tokens first, the first with nothing before it.
    tops = choice["logprobs"]["top_logprobs"]
    assert len(tops) == len(c.seq.prompt_ids) + 1 and tops[0] is None
    assert tops[-1] == {" yes": -2.0, " no": -0.5}


def run_text(decoder: Decoder, text: str, settings: Settings, **fields) -> tuple[list, dict]:
    run = JobRun(job(**fields), model_info(200, (2,)), decoder, settings=settings)
    events = run.start()
    c = run.choices[0]
    for t in [*ids(decoder, text), 2]:
        c.seq.output_ids.append(t)
        events += run.on_output(c, Output(c.seq, t, Finish.stop if t == 2 else None))[0]
    closing, end = run.end()
    return events + closing, end.result


@pytest.mark.parametrize(
    ("fields", "carries_result"),
    [
        ({}, True),
        ({"stream": True}, False),
        ({"background": True}, False),
        ({"stream": True, "background": True}, False),
    ],
)
def test_done_carries_the_answer_only_to_a_waiting_client(decoder, fields, carries_result):
    events, result = run_text(decoder, "Fine, thanks.", Settings(), **fields)
    done = events[-1]
    assert done.event is EventKind.done
    if carries_result:
        assert done.data == result and result["choices"][0]["message"]["content"] == "Fine, thanks."
    else:
        assert done.data is None
        assert done.sse_data() == b"[DONE]"


def test_reasoning_is_split_from_content_and_counted(decoder):
    settings = Settings(reasoning_parser="qwen3")
    text = "<think>The user greets me.</think>\n\nHello!"
    events, result = run_text(decoder, text, settings)
    message = result["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("The user greets me.", "\n\nHello!")
    # The thought's own tokens; not those of its tags.
    reasoning_tokens = result["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert reasoning_tokens == len(ids(decoder, "The user greets me."))
    deltas = [e.data["choices"][0]["delta"] for e in events if e.event is EventKind.chunk and e.data["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == "The user greets me."
    assert "".join(d.get("content", "") for d in deltas) == "\n\nHello!"

    # Hidden reasoning is still counted, and its tokens do not show through logprobs either.
    events, hidden = run_text(decoder, text, settings, include_reasoning=False, logprobs=True, stream=True)
    assert hidden["choices"][0]["message"]["reasoning"] is None and hidden["choices"][0]["logprobs"] is None
    assert hidden["usage"]["completion_tokens_details"]["reasoning_tokens"] == reasoning_tokens
    assert all(c["logprobs"] is None for e in events if e.event is EventKind.chunk for c in e.data["choices"])

    _, off = run_text(decoder, "Just an answer.", settings, chat_template_kwargs={"enable_thinking": False})
    assert off["choices"][0]["message"]["content"] == "Just an answer."
    _, effortless = run_text(decoder, "Just an answer.", settings, reasoning_effort="none")  # vLLM: no thinking
    assert effortless["choices"][0]["message"]["content"] == "Just an answer."
    # Nothing after the reasoning is no content at all, as vLLM's reasoning parsers answer it.
    _, unfinished = run_text(decoder, "Still thinking about it", settings)
    message = unfinished["choices"][0]["message"]
    assert (message["content"], message["reasoning"]) == (None, "Still thinking about it")
    _, closed = run_text(decoder, "<think>Nothing to add.</think>", settings)
    assert closed["choices"][0]["message"]["content"] is None


def test_deepseek_r1_thinks_whatever_the_request_asks(decoder):
    # Its chat templates take no `enable_thinking`, so the thought comes anyway and is read as one, as vLLM does.
    settings = Settings(reasoning_parser="deepseek_r1")
    text = "The user wants X.</think>\n\nAnswer."
    for fields in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        _, result = run_text(decoder, text, settings, **fields)
        message = result["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("The user wants X.", "\n\nAnswer.")


def test_streamed_usage_counts_reasoning_like_the_answer(decoder):
    settings = Settings(reasoning_parser="qwen3")
    text = "<think>The user greets me.</think>\n\nHello!"
    _, answer = run_text(decoder, text, settings)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    events, _ = run_text(decoder, text, settings, stream=True, stream_options=opts)
    chunks = [e.data for e in events if e.event is EventKind.chunk]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] | {"prompt_tokens_details": None} == answer["usage"]
    assert answer["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    running = [c["usage"]["completion_tokens_details"]["reasoning_tokens"] for c in chunks if c["choices"]]
    assert (
        running == sorted(running) and running[-1] == answer["usage"]["completion_tokens_details"]["reasoning_tokens"]
    )


def test_a_grammar_holds_what_follows_the_reasoning_not_the_reasoning(decoder):
    info = model_info()
    compiler = GrammarCompiler(info.tokenizer, info.vocab_size, eos_token_ids=[2])
    settings = Settings(reasoning_parser="qwen3")

    def started(**fields) -> JobRun:
        fields = {"response_format": {"type": "json_object"}, **fields}
        run = JobRun(job(**fields), model_info(200, (2,)), decoder, settings=settings, compiler=compiler)
        run.start()
        return run

    run = started()
    c = run.choices[0]
    for t in ids(decoder, "<think>Free text, not JSON.</think>"):
        assert c.seq.grammar is None  # the thought is free, as in vLLM
        c.seq.output_ids.append(t)
        run.on_output(c, Output(c.seq, t, None))
    assert c.seq.grammar is not None and all(c.seq.grammar.accept(t) for t in ids(decoder, '{"a": 1}'))
    assert not c.seq.grammar.accept(ids(decoder, "x")[0])
    # Thinking switched off: the format holds from the first token.
    assert started(chat_template_kwargs={"enable_thinking": False}).choices[0].seq.grammar is not None


def test_hermes_calls_from_auto_tool_choice(decoder):
    settings = Settings(tool_parser="hermes")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    events, result = run_text(decoder, text, settings, tools=tools)
    choice = result["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    _, none = run_text(decoder, text, settings, tools=tools, tool_choice="none")
    assert none["choices"][0]["message"]["content"] == text and none["choices"][0]["finish_reason"] == "stop"

    twice = text + '\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    _, both = run_text(decoder, twice, settings, tools=tools)
    assert [c["function"]["arguments"] for c in both["choices"][0]["message"]["tool_calls"]] == [
        '{"city": "Paris"}',
        '{"city": "Rome"}',
    ]
    events, one = run_text(decoder, twice, settings, tools=tools, parallel_tool_calls=False, stream=True)
    assert [c["function"] for c in one["choices"][0]["message"]["tool_calls"]] == [call["function"]]
    assert one["choices"][0]["finish_reason"] == "tool_calls"
    streamed = [
        tc
        for e in events
        if e.event is EventKind.chunk and e.data["choices"]
        for tc in e.data["choices"][0]["delta"].get("tool_calls", [])
    ]
    assert {tc["index"] for tc in streamed} == {0} and streamed[0]["function"]["name"] == "get_weather"
    assert "".join(tc["function"]["arguments"] for tc in streamed) == call["function"]["arguments"]


AUTO_CALLS = {
    "hermes": 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
    "pythonic": '[get_weather(city="Paris", days=3)]',
}


@pytest.mark.parametrize("parser", sorted(AUTO_CALLS))
def test_auto_tool_calls_stream_token_by_token_as_the_whole_answer_has_them(decoder, parser):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = AUTO_CALLS[parser]
    events, streamed = run_text(decoder, text, Settings(tool_parser=parser), tools=tools, stream=True)
    _, whole = run_text(decoder, text, Settings(tool_parser=parser), tools=tools)
    chunks = [e.data["choices"][0] for e in events if e.event is EventKind.chunk and e.data["choices"]]
    entries = [tc for c in chunks for tc in c["delta"].get("tool_calls", [])]
    head, fragments = entries[0], entries[1:]
    assert head["id"] == whole["choices"][0]["message"]["tool_calls"][0]["id"]
    assert head["type"] == "function" and head["function"] == {"name": "get_weather", "arguments": ""}
    assert all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"} for f in fragments)
    assert (
        len(fragments) > 1 and "".join(f["function"]["arguments"] for f in fragments) == '{"city": "Paris", "days": 3}'
    )
    assert streamed["choices"] == whole["choices"] and chunks[-1]["finish_reason"] == "tool_calls"


def feed_all(run: JobRun, token_ids: list[int], last_finish: Finish, logprobs: bool = False) -> tuple[list, dict]:
    """Runs the tokens through the job's first choice, the last one ending it; the events and the final object."""
    events = run.start()
    c = run.choices[0]
    for i, t in enumerate(token_ids):
        c.seq.output_ids.append(t)
        lp = TokenLogprob(-1.0, []) if logprobs else None
        events += run.on_output(c, Output(c.seq, t, last_finish if i == len(token_ids) - 1 else None, lp))[0]
    closing, end = run.end()
    return events + closing, end.result


@pytest.mark.parametrize(
    ("text", "stop"),
    [("Hello world", ["o x"]), ("I 😀 日本 ok", []), ("Caf\u00e9 naïve 😀😀 end", ["😀 e"])],
)
def test_legacy_text_offsets_are_where_each_token_begins_streamed_or_not(decoder, text, stop):
    offsets = {}
    for stream in (False, True):
        request = CompletionRequest(prompt="x", logprobs=0, stream=stream, stop=stop)
        run = JobRun(
            Job(id="cmpl-t", model="m", request=request, prompt_ids=[1]),
            model_info(100, (2,)),
            decoder,
            settings=Settings(),
        )
        events, result = feed_all(run, ids(decoder, text), Finish.length, logprobs=True)
        if stream:
            chunks = [e.data["choices"][0] for e in events if e.event is EventKind.chunk and e.data["choices"]]
            offsets[stream] = [o for c in chunks if c.get("logprobs") for o in c["logprobs"]["text_offset"]]
        else:
            offsets[stream] = result["choices"][0]["logprobs"]["text_offset"]
            final_text = result["choices"][0]["text"]
    assert offsets[True] == offsets[False] == sorted(offsets[False])
    assert len(offsets[False]) == len(ids(decoder, text)) and offsets[False][-1] < len(text)
    assert final_text == text.split(stop[0])[0] if stop and stop[0] in text else final_text == text


def test_a_stop_token_shows_in_the_text_when_stops_are_asked_for_and_is_named(decoder):
    period = ids(decoder, ".")[0]
    tokens = [*ids(decoder, "Hi there"), period]
    run = JobRun(
        job(stop_token_ids=[period], include_stop_str_in_output=True),
        model_info(200, (2,)),
        decoder,
        settings=Settings(),
    )
    _, result = feed_all(run, tokens, Finish.stop)
    choice = result["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"], choice["stop_reason"]) == (
        "Hi there.",
        "stop",
        period,
    )
    # EOS asked for as a stop token while EOS itself is ignored: it is the request's stop, and named.
    run = JobRun(job(stop_token_ids=[2], ignore_eos=True), model_info(200, (2,)), decoder, settings=Settings())
    _, result = feed_all(run, [*ids(decoder, "Hi there"), 2], Finish.stop)
    choice = result["choices"][0]
    assert (choice["message"]["content"], choice["stop_reason"]) == ("Hi there", 2)


def _feed(run: JobRun, tokens: list[int], events: list, steps: list[int] | None = None) -> dict:
    """Adds the events of `tokens` (the last one EOS), handed over one a step as the engine would, with made-up
    logprobs; the result. `steps` gets the number of events after each step that leaves the job running."""
    c = run.choices[0]
    if c.seq.params.prompt_logprobs is not None:  # as the prefill before the first token makes them
        c.seq.prompt_logprobs = [TokenLogprob(-1.0 - i, [(i + 3, -0.5)], 2) for i in range(len(c.seq.prompt_ids) - 1)]
    for t in tokens[len(c.seq.output_ids) :]:
        if c.seq.grammar is not None:
            c.seq.grammar.accept(t)
        c.seq.output_ids.append(t)
        logprob = TokenLogprob(-0.25, [(t, -0.25), (t + 1, -1.5)])
        events += run.on_output(c, Output(c.seq, t, Finish.stop if t == 2 else None, logprob))[0]
        if steps is not None and c.finish_reason is None:
            steps.append(len(events))
    closing, end = run.end()
    events += closing
    return end.result


RESUMED = {
    "a stop string after held-back text": (
        {"stream": True, "logprobs": True, "top_logprobs": 2, "stop": ["plaît"]},
        "Un café au lait, s'il vous plaît 🙂 merci",
        Settings(),
    ),
    "reasoning, then the answer": ({"stream": True}, "<think>Hmm, 🙂 a greeting.</think>\n\nHello!", None),
    "a required tool call": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
        | {"tool_choice": "required"},
        '[{"name": "f", "parameters": {"city": "Paris"}}]',
        Settings(),
    ),
    "hermes calls streamed under auto": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "stream": True},
        'Sure. <tool_call>{"name": "f", "arguments": {"city": "Paris", "days": [1, 2]}}</tool_call>',
        Settings(tool_parser="hermes"),
    ),
    "a JSON object held by the grammar": ({"response_format": {"type": "json_object"}}, '{"a": [1, 2]}', Settings()),
    "a legacy echo with text offsets": (None, " and then some 🙂 more", Settings()),
    "token ids, and logprobs naming tokens by id": (
        {"stream": True, "logprobs": True, "return_token_ids": True, "return_tokens_as_token_ids": True},
        "Un café 🙂 merci",
        Settings(),
    ),
}


@pytest.mark.parametrize("case", RESUMED)
def test_a_job_resumed_from_any_point_of_its_log_continues_it_exactly(decoder, case):
    fields, text, settings = RESUMED[case]
    settings = settings or Settings(reasoning_parser="qwen3")
    if fields is None:
        request = CompletionRequest(prompt="Say it twice", echo=True, logprobs=2, stream=True)
        prompt_ids = ids(decoder, "Say it twice")
        the_job = Job(id="cmpl-resumed", model="m", kind="text", request=request, prompt_ids=prompt_ids)
    else:
        the_job = job(**fields)
    info = model_info(200, (2,))
    compiler = GrammarCompiler(decoder.tokenizer, info.vocab_size, eos_token_ids=(2,))
    tokens = [*ids(decoder, text), 2]

    def run() -> JobRun:
        return JobRun(the_job, info, decoder, settings=settings, compiler=compiler)

    first, steps = run(), []
    events = first.start()
    whole = _feed(first, tokens, events, steps)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    logged = [t for e in events for t in e.ids or []]
    assert len(logged) > 5 and logged == tokens[: len(logged)]
    # A worker dies after any step: the next one takes the log so far and goes on from its last event.
    for cut in steps:
        again = run()
        again.resume(events[:cut])
        resumed = events[:cut] + again.start()
        result = _feed(again, tokens, resumed)
        assert [e.to_json() for e in resumed] == [e.to_json() for e in events], f"cut after {cut}"
        assert result == whole


def test_logprob_bytes_of_tokens_that_split_a_character_join_into_it(decoder):
    text = "\u200b日本 ok"  # a zero-width space and 日 each take two tokens here
    run = JobRun(job(logprobs=True, top_logprobs=1, stream=True), model_info(200, (2,)), decoder, settings=Settings())
    events = run.start()
    c = run.choices[0]
    tokens = ids(decoder, text)
    assert any(decoder.token(t) == "\ufffd" for t in tokens)
    for t in [*tokens, 2]:
        c.seq.output_ids.append(t)
        finish = Finish.stop if t == 2 else None
        events += run.on_output(c, Output(c.seq, t, finish, TokenLogprob(-1.0, [(t, -1.0)])))[0]
    streamed = [
        e
        for ev in events
        if ev.data
        for ch in ev.data.get("choices", [])
        for e in (ch["logprobs"] or {}).get("content", [])
    ]
    [choice] = run.end()[1].result["choices"]
    for entries in (streamed, choice["logprobs"]["content"]):
        assert bytes(b for e in entries for b in e["bytes"]).decode() == text
        assert all(e["bytes"] == e["top_logprobs"][0]["bytes"] for e in entries)
