"""The playground page at /, in a real headless browser (Debian's chromium, driven by Playwright) against the real
stack: a streamed answer, a tool call, a stop, a background job opened from the jobs view, batches with their
progress, output and cancel, and API keys."""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from chatq.core import keys
from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.job import Event, EventKind, Job, JobStatus
from tests.api.conftest import ADMIN, KEY_A, Guarded
from tests.helpers import wait_for

CHROMIUM = shutil.which("chromium")
if CHROMIUM is None:
    pytest.skip(
        "the playground's browser test needs Debian's chromium: apt-get install -y --no-install-recommends chromium",
        allow_module_level=True,
    )
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")
TIMEOUT = 60_000  # ms: a CPU worker may be busy with other tests' jobs first
expect = sync_api.expect
expect.set_options(timeout=TIMEOUT)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        # --no-sandbox: CI runs as root, where chromium's sandbox refuses to start.
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, stack: str) -> Iterator[Any]:
    context = browser.new_context(base_url=stack)
    context.set_default_timeout(TIMEOUT)
    p = context.new_page()
    script_errors: list[Any] = []
    p.on("pageerror", lambda e: script_errors.append(e))
    p.goto("/")
    yield p
    context.close()
    assert not script_errors  # the page's script threw nothing


def _send(page: Any, text: str, max_tokens: int, extra: dict | None = None) -> None:
    page.fill("#max-tokens", str(max_tokens))
    if extra is not None:
        page.click("details summary")
        page.fill("#extra", json.dumps(extra))
    page.fill("#prompt", text)
    page.click("#send")


def _content(job: dict) -> str:
    return job["choices"][0]["message"]["content"]


def test_a_message_gets_a_streamed_answer(page: Any, http: httpx.Client, model_name: str):
    expect(page.locator("#model")).to_contain_text(model_name)
    _send(page, "Count from 1 to 30, one number per line.", 40, {"temperature": 0})
    answer = page.locator("#log .msg.assistant").last
    # Text shows while the answer is still being generated (Stop is enabled until the stream ends).
    partial = page.wait_for_function(
        """() => { const t = document.querySelector('#log .msg.assistant:last-child .content').textContent;
                   return !document.getElementById('stop').disabled && t.length > 0 && t; }"""
    ).json_value()
    expect(page.locator("#stop")).to_be_disabled()
    final = answer.locator(".content").text_content()
    assert final.startswith(partial) and len(final) > len(partial)
    job = http.get(f"/v1/chat/completions/{answer.get_attribute('data-job')}").json()
    assert job["status"] == "completed" and _content(job) == final
    expect(answer.locator(".finish")).to_have_text("finished: length")
    expect(page.locator("#log .msg.user")).to_have_text(["Count from 1 to 30, one number per line."])


def test_a_tool_call_shows_as_one(page: Any, http: httpx.Client):
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
            },
        },
    }
    # Greedy, and a short city, so the call ends well inside its tokens (a sampled one can ramble past them).
    forced = {
        "tools": [weather],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0,
    }
    _send(page, "What is the weather in Paris?", 60, forced)
    call = page.locator("#log .msg.assistant .tool-call")
    expect(call).to_have_text(re.compile(r"^tool call: get_weather\(\{.*\}\)$"))
    expect(page.locator("#log .msg.assistant .finish")).to_have_text("finished: stop")
    job_id = page.locator("#log .msg.assistant").last.get_attribute("data-job")
    done = wait_for(http, job_id, lambda j: j["status"] == "completed")
    [stored] = done["choices"][0]["message"]["tool_calls"]
    assert call.text_content() == f"tool call: get_weather({stored['function']['arguments']})"


def test_stop_cancels_a_long_generation(page: Any, http: httpx.Client):
    _send(page, "Count from 1 to 1000, one number per line.", 2000)
    answer = page.locator("#log .msg.assistant").last
    expect(answer.locator(".content")).not_to_be_empty()
    page.click("#stop")
    expect(answer.locator(".finish")).to_have_text("stopped")
    job = wait_for(http, answer.get_attribute("data-job"), lambda j: j["status"] != "in_progress", timeout=30)
    assert job["status"] == "cancelled" and job["choices"][0]["finish_reason"] == "abort"
    assert job["usage"]["completion_tokens"] < 2000


def test_a_background_job_is_listed_and_opened_from_the_jobs_view(page: Any, http: httpx.Client):
    page.check("#background")
    _send(page, "Write three short lines about the sea.", 30)
    expect(page.locator("#notice")).to_contain_text("chatcmpl-")
    job_id = page.locator("#notice").text_content().split()[1]
    row = page.locator(f"#job-rows tr[data-id='{job_id}']")
    expect(row.locator(".status")).to_have_text(re.compile("queued|in_progress|completed"))
    row.locator("button.open").click()
    output = page.locator("#job-output .content")
    expect(page.locator("#job-title")).to_have_text(job_id)
    done = wait_for(http, job_id, lambda j: j["status"] == "completed")
    expect(output).to_have_text(_content(done))
    expect(row.locator(".status")).to_have_text("completed")
    # Opened again, it resumes after the last event it showed (nothing is left: a 204): the whole answer, once.
    with page.expect_response(lambda r: f"/{job_id}?stream=true" in r.url) as resumed:
        page.locator(f"#job-rows tr[data-id='{job_id}'] button.open").click()
    assert resumed.value.status == 204 and "starting_after=0" not in resumed.value.url
    expect(page.locator("#job-output .finish")).to_have_text(f"finished: {done['choices'][0]['finish_reason']}")
    assert output.text_content() == _content(done)
    assert page.locator("#log .msg").count() == 0  # a background job is not in the chat


def _reasoned_job(r: redis.Redis, model: str) -> str:
    """A finished job as a worker with a reasoning parser leaves it, in the open API's list: the default model writes
    no thoughts, and a parser is a worker's setting, so this stack's worker has none."""
    job_id = f"chatcmpl-pg-{uuid.uuid4().hex[:8]}"
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Why?"}])
    deltas = [{"role": "assistant"}, {"reasoning": "Let me think. "}, {"reasoning": "Yes."}, {"content": "Because."}]
    chunks = [{"id": job_id, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d}]} for d in deltas]
    chunks[-1]["choices"][0]["finish_reason"] = "stop"
    message = {"role": "assistant", "content": "Because.", "reasoning": "Let me think. Yes."}
    result = {"id": job_id, "object": "chat.completion", "choices": [{"index": 0, "message": message}]}
    job = Job(id=job_id, model=model, request=request, status=JobStatus.completed, result=result)
    r.hset(keys.job(job_id), mapping=job.to_redis())
    events = [Event(seq=i, event=EventKind.chunk, data=c) for i, c in enumerate(chunks, 1)]
    for e in [*events, Event(seq=len(events) + 1, event=EventKind.done)]:
        r.xadd(keys.events(job_id), {"msg": e.to_json()}, id=f"0-{e.seq}")
    r.zadd(keys.owner_jobs(""), {job_id: time.time()})
    for key in (keys.job(job_id), keys.events(job_id)):
        r.expire(key, 600)
    return job_id


def test_reasoning_shows_in_a_collapsed_block(page: Any, r: redis.Redis, model_name: str):
    job_id = _reasoned_job(r, model_name)
    page.click("#refresh")
    page.locator(f"#job-rows tr[data-id='{job_id}'] button.open").click()
    expect(page.locator("#job-output .content")).to_have_text("Because.")
    reasoning = page.locator("#job-output details.reasoning")
    expect(reasoning.locator("summary")).to_have_text("reasoning")
    expect(reasoning.locator(".reasoning-text")).to_be_hidden()  # collapsed until clicked
    reasoning.locator("summary").click()
    expect(reasoning.locator(".reasoning-text")).to_have_text("Let me think. Yes.")


def test_the_page_asks_for_a_key_when_the_api_needs_one(browser: Any, guarded: Guarded):
    context = browser.new_context(base_url=guarded.base)
    context.set_default_timeout(TIMEOUT)
    try:
        page = context.new_page()
        resp = page.goto("/")  # the page itself needs no key
        assert resp.status == 200 and resp.headers["content-security-policy"] == "default-src 'self'"
        expect(page.locator("#notice")).to_have_text("This API needs an API key: enter it above.")
        expect(page.locator("#key-field")).to_be_visible()
        page.fill("#key", "wrong-key")
        page.press("#key", "Enter")
        expect(page.locator("#notice")).to_have_text("The API key was refused: check it above.")
        page.fill("#key", KEY_A)
        page.press("#key", "Enter")
        expect(page.locator("#model")).to_contain_text(guarded.settings.model_name)
        # ignore_eos: a sampled answer could end before its 8 tokens.
        _send(page, "Say hi.", 8, {"ignore_eos": True})
        answer = page.locator("#log .msg.assistant").last
        expect(answer.locator(".finish")).to_have_text("finished: length")
        job_id = answer.get_attribute("data-job")
        expect(page.locator(f"#job-rows tr[data-id='{job_id}']")).to_be_visible()
        # The key stays for the next visit.
        page.reload()
        expect(page.locator("#key")).to_have_value(KEY_A)
        expect(page.locator(f"#job-rows tr[data-id='{job_id}'] .status")).to_have_text("completed")
    finally:
        context.close()


def _batch(http: httpx.Client, model: str, lines: int, max_tokens: int) -> str:
    rows = [
        {
            "custom_id": f"pg{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": max_tokens},
        }
        for i in range(lines)
    ]
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    uploaded = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", data)}).json()
    body = {"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    return http.post("/v1/batches", json=body).json()["id"]


def test_batches_show_their_progress_and_give_their_output_or_a_cancel(page: Any, http: httpx.Client, model_name: str):
    done_id = _batch(http, model_name, 3, 4)
    long_id = _batch(http, model_name, 200, 64)
    row = page.locator(f"#batch-rows tr[data-id='{done_id}']")
    expect(row.locator(".status")).to_have_text("completed")
    expect(row.locator(".progress")).to_have_text("3 / 3")
    assert row.locator("progress").get_attribute("value") == "3"
    with page.expect_download() as downloaded:
        row.locator("button.output").click()
    lines = [json.loads(line) for line in Path(downloaded.value.path()).read_text().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == ["pg0", "pg1", "pg2"]
    running = page.locator(f"#batch-rows tr[data-id='{long_id}']")
    expect(running.locator(".status")).to_have_text("in_progress")
    running.locator("button.cancel").click()
    expect(running.locator(".status")).to_have_text(re.compile("cancelling|cancelled"))
    expect(running.locator(".status")).to_have_text("cancelled")
    expect(running.locator("button.errors")).to_be_visible()
    assert http.get(f"/v1/batches/{long_id}").json()["status"] == "cancelled"


def test_a_managed_key_sees_its_limits_and_usage(browser: Any, guarded: Guarded):
    name = f"pg-{uuid.uuid4().hex[:6]}"
    made = guarded.client(ADMIN).post("/v1/admin/keys", json={"name": name, "rpm": 600, "tpm": 90000, "in_flight": 4})
    key = made.json()["value"]
    context = browser.new_context(base_url=guarded.base)
    context.set_default_timeout(TIMEOUT)
    try:
        page = context.new_page()
        page.goto("/")
        page.fill("#key", key)
        page.press("#key", "Enter")
        expect(page.locator("#key-limits")).to_have_text(
            re.compile(rf"^Key {name}: 600 requests/min; 90,000 tokens/min; 4 in flight\.$")
        )
        expect(page.locator("#model")).to_contain_text(guarded.settings.model_name)
        _send(page, "Say hi.", 4, {"ignore_eos": True})
        expect(page.locator("#log .msg.assistant .finish").last).to_have_text("finished: length")
        page.click("#refresh")
        row = page.locator(f"#usage-rows tr[data-model='{guarded.settings.model_name}']")
        expect(row.locator("td.n").nth(0)).to_have_text("1")
        expect(row.locator("td.n").nth(2)).to_have_text("4")
    finally:
        context.close()
