"""/v1/batches through the official openai SDK, on an API with keys beside the session's stack (whose worker serves
the model the lines name): a batch runs every line, its output and error files answering each once as the requests
sent directly answer; each bad line fails the batch naming it, bad create fields are 400s that create nothing, a
cancel mid-way and a window that passes end it with the finished lines kept and the rest reported, lists page newest
first, another key's batch is not found, and a batch's end sends OpenAI's signed batch.* webhook."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
from pydantic import SecretStr

from chatq.api.auth import key_hash
from chatq.cli import webhooks_command
from chatq.core import keys
from chatq.core.batches import Batch, create, new_id
from chatq.core.settings import Settings
from chatq.embedded_redis import free_port
from tests.helpers import ROOT, _env, assert_error, running_api
from tests.worker.test_webhooks import SECRET, Receiver, serve

KEY_A, KEY_B = "batches-key-a-0123", "batches-key-b-4567"


@pytest.fixture(scope="module")
def base(stack: str, settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    keyed = settings.model_copy(update={"api_port": free_port(), "api_keys": SecretStr(f"{KEY_A},{KEY_B}")})
    with running_api(keyed, tmp_path_factory.mktemp("batches-logs")) as url:
        yield url


def sdk(base: str, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


def chat_line(custom_id: str, model: str, **body: Any) -> dict[str, Any]:
    request = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4} | body
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": request}


def upload(client: openai.OpenAI, lines: list[Any], purpose: str = "batch") -> str:
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n"
    return client.files.create(file=("in.jsonl", text.encode()), purpose=purpose).id  # type: ignore[arg-type]


def settle(client: openai.OpenAI, batch_id: str, timeout: float = 30) -> Any:
    """The batch once it has left `validating`."""
    deadline = time.time() + timeout
    while (batch := client.batches.retrieve(batch_id)).status == "validating":
        assert time.time() < deadline, batch
        time.sleep(0.1)
    return batch


def wait_status(client: openai.OpenAI, batch_id: str, *statuses: str, timeout: float = 300) -> Any:
    """The batch once it is in one of `statuses`."""
    deadline = time.time() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in statuses:
        assert time.time() < deadline, batch
        time.sleep(0.2)
    return batch


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    record = client.files.retrieve(file_id)
    assert record.purpose == "batch_output", record  # type: ignore[comparison-overlap]
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def greedy_line(custom_id: str, model: str, text: str, system: str | None = None, **body: Any) -> dict[str, Any]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return chat_line(custom_id, model, **({"messages": messages, "temperature": 0, "max_tokens": 12} | body))


def run_batch(client: openai.OpenAI, lines: list[Any], endpoint: str = "/v1/chat/completions") -> Any:
    created = client.batches.create(input_file_id=upload(client, lines), endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
    return wait_status(client, created.id, "completed", "failed", "cancelled", "expired")


def test_a_batch_answers_every_line_once_as_direct_requests_answer(base: str, model_name: str, r: redis.Redis) -> None:
    client = sdk(base)
    system = "You are a terse assistant. Answer in one short sentence."
    lines = [greedy_line(f"s{i}", model_name, q, system) for i, q in enumerate(["Name a color.", "Name a fruit."])]
    lines += [greedy_line(f"p{i}", model_name, q) for i, q in enumerate(["Say hi.", "Count to three.", "Name a sea."])]
    lines.append(greedy_line("too-long", model_name, "Hi", max_tokens=10**6))  # refused before it runs
    lines.append(greedy_line("no-parser", model_name, "Hi", thinking_token_budget=4))  # refused by its worker
    batch = run_batch(client, lines)
    assert batch.status == "completed" and batch.completed_at is not None and batch.finalizing_at is not None, batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (7, 5, 2)
    outputs, errors = file_lines(client, batch.output_file_id), file_lines(client, batch.error_file_id)
    assert sorted(o["custom_id"] for o in outputs) == ["p0", "p1", "p2", "s0", "s1"]
    assert sorted(e["custom_id"] for e in errors) == ["no-parser", "too-long"]
    for line in lines[:5]:
        [out] = [o for o in outputs if o["custom_id"] == line["custom_id"]]
        assert out["id"].startswith("batch_req_") and out["error"] is None
        response = out["response"]
        assert response["status_code"] == 200 and response["request_id"] == response["body"]["id"]
        direct = client.chat.completions.create(**line["body"])
        assert response["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert response["body"]["object"] == "chat.completion"
        assert not r.exists(keys.job(response["request_id"]))  # an answered line's job leaves nothing behind
    for error in errors:
        assert error["error"] is None and error["response"]["status_code"] == 400, error
        assert error["response"]["body"]["error"]["message"]
    usage = batch.usage
    assert usage.input_tokens == sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in outputs)
    assert usage.output_tokens == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in outputs)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert not r.exists(keys.batch_results(batch.id), keys.batch_released(batch.id))


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/responses"])
def test_legacy_and_responses_batches_answer_as_their_routes(base: str, model_name: str, endpoint: str) -> None:
    client = sdk(base)
    prompts = ["The capital of France is", "One, two,"]
    if endpoint == "/v1/completions":
        bodies = [{"model": model_name, "prompt": p, "max_tokens": 8, "temperature": 0} for p in prompts]
    else:
        bodies = [{"model": model_name, "input": p, "max_output_tokens": 8, "temperature": 0} for p in prompts]
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": endpoint, "body": b} for i, b in enumerate(bodies)]
    batch = run_batch(client, lines, endpoint)
    assert batch.status == "completed" and batch.error_file_id is None, batch
    outputs = {o["custom_id"]: o["response"]["body"] for o in file_lines(client, batch.output_file_id)}
    for i, body in enumerate(bodies):
        if endpoint == "/v1/completions":
            direct = client.completions.create(**body)
            assert outputs[f"c{i}"]["choices"][0]["text"] == direct.choices[0].text
        else:
            answer = client.responses.create(**body)
            assert outputs[f"c{i}"]["object"] == "response" and outputs[f"c{i}"]["status"] == answer.status
            assert outputs[f"c{i}"]["output"][0]["content"][0]["text"] == answer.output_text


def long_lines(model: str, n: int, max_tokens: int = 48) -> list[dict[str, Any]]:
    return [chat_line(f"l{i}", model, max_tokens=max_tokens, ignore_eos=True, temperature=0) for i in range(n)]


def assert_each_line_once(client: openai.OpenAI, batch: Any, n: int, code: str) -> tuple[list, list]:
    """Every custom_id in exactly one of the files; the unanswered ones reported with `code`."""
    outputs, errors = file_lines(client, batch.output_file_id), file_lines(client, batch.error_file_id)
    assert sorted(line["custom_id"] for line in outputs + errors) == sorted(f"l{i}" for i in range(n))
    assert all(e["response"] is None and e["error"]["code"] == code for e in errors), errors
    assert all(o["response"]["status_code"] == 200 for o in outputs)
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (n, len(outputs), len(errors))
    return outputs, errors


def test_a_batch_cancelled_mid_way_keeps_its_finished_lines(base: str, model_name: str) -> None:
    client = sdk(base)
    created = client.batches.create(
        input_file_id=upload(client, long_lines(model_name, 60)),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    settle(client, created.id)
    deadline = time.time() + 300
    while (batch := client.batches.retrieve(created.id)).request_counts.completed < 2:
        assert batch.status == "in_progress" and time.time() < deadline, batch
        time.sleep(0.2)
    assert client.batches.cancel(created.id).status in ("cancelling", "cancelled")
    batch = wait_status(client, created.id, "cancelled")
    assert batch.cancelling_at is not None and batch.cancelled_at is not None
    outputs, errors = assert_each_line_once(client, batch, 60, "batch_cancelled")
    assert len(outputs) >= 2 and errors


def test_a_good_file_goes_in_progress_in_openais_shape(base: str, model_name: str) -> None:
    client = sdk(base)
    file_id = upload(client, [chat_line(f"r{i}", model_name) for i in range(3)])
    created = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"job": "nightly"}
    )
    assert created.id.startswith("batch_") and created.object == "batch"
    assert (created.status, created.input_file_id, created.metadata) == ("validating", file_id, {"job": "nightly"})
    assert created.expires_at == created.created_at + 86400
    batch = settle(client, created.id)
    assert batch.status in ("in_progress", "finalizing", "completed") and batch.in_progress_at is not None, batch
    assert batch.request_counts is not None and batch.request_counts.total == 3
    assert batch.model == model_name and batch.errors is None


@pytest.mark.parametrize(
    ("line", "code", "param"),
    [
        ("not json", "invalid_json_line", None),
        ({"method": "POST", "url": "/v1/chat/completions", "body": {}}, "missing_required_parameter", "custom_id"),
        ("dup", "duplicate_custom_id", "custom_id"),
        ({"custom_id": "x", "method": "GET", "url": "/v1/chat/completions", "body": {}}, "invalid_method", "method"),
        ({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}}, "invalid_url", "url"),
        ("stream", "invalid_request", "body.stream"),
        ("background", "invalid_request", "body.background"),
        ("no-messages", "invalid_request", "body.messages"),
        ("other-model", "model_not_found", "body.model"),
    ],
)
def test_a_bad_line_fails_the_batch_naming_it(
    base: str, model_name: str, line: Any, code: str, param: str | None
) -> None:
    client = sdk(base)
    special = {
        "dup": chat_line("a", model_name),
        "stream": chat_line("x", model_name, stream=True),
        "background": chat_line("x", model_name, background=True),
        "no-messages": {
            "custom_id": "x",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model_name},
        },
        "other-model": chat_line("x", "no-such-model"),
    }
    bad = special.get(line, line) if isinstance(line, str) else line
    file_id = upload(client, [chat_line("a", model_name), bad, chat_line("c", model_name)])
    created = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = settle(client, created.id)
    assert batch.status == "failed" and batch.failed_at is not None, batch
    assert batch.errors is not None and batch.errors.data is not None
    [error] = batch.errors.data
    assert (error.line, error.code, error.param) == (2, code, param), error
    assert error.message


def test_bad_create_fields_are_400s_that_create_nothing(base: str, model_name: str, r: redis.Redis) -> None:
    client = sdk(base)
    good = upload(client, [chat_line("a", model_name)])
    other = upload(client, [chat_line("a", model_name)], purpose="user_data")
    before = set(r.scan_iter(keys.batch("*")))
    ok = {"input_file_id": good, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    cases = [
        ({"input_file_id": "file-nosuch"}, "input_file_id"),
        ({"input_file_id": other}, "input_file_id"),
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "48h"}, "completion_window"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ]
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY_A}"}) as http:
        for change, param in cases:
            assert_error(http.post("/v1/batches", json=ok | change), 400, "BadRequestError", param)
        # another key's file is not found either
        theirs = upload(sdk(base, KEY_B), [chat_line("a", model_name)])
        assert_error(
            http.post("/v1/batches", json=ok | {"input_file_id": theirs}), 400, "BadRequestError", "input_file_id"
        )
    assert set(r.scan_iter(keys.batch("*"))) == before


def test_cancel_ends_cancelled_and_lists_page_newest_first(base: str, model_name: str) -> None:
    client = sdk(base, KEY_B)
    file_id = upload(client, [chat_line("a", model_name)])
    made = [
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h").id
        for _ in range(3)
    ]
    assert client.batches.cancel(made[0]).status in ("cancelling", "cancelled")
    cancelled = wait_status(client, made[0], "cancelled", timeout=60)
    assert cancelled.cancelling_at is not None and cancelled.cancelled_at is not None
    assert client.batches.cancel(made[0]).status == "cancelled"  # a second cancel changes nothing
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == made[:0:-1] and first.has_more
    rest = client.batches.list(limit=2, after=made[1])
    assert [b.id for b in rest.data] == [made[0]] and not rest.has_more


def test_another_keys_batch_is_not_found(base: str, model_name: str) -> None:
    mine = sdk(base, KEY_A)
    batch = mine.batches.create(
        input_file_id=upload(mine, [chat_line("a", model_name)]),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    theirs = sdk(base, KEY_B)
    for call in (theirs.batches.retrieve, theirs.batches.cancel):
        with pytest.raises(openai.NotFoundError):
            call(batch.id)
    assert batch.id not in [b.id for b in theirs.batches.list().data]
    with pytest.raises(openai.AuthenticationError):
        sdk(base, "wrong-key").batches.retrieve(batch.id)


def test_a_batch_past_its_window_expires_with_its_finished_lines_kept(
    stack: str, settings: Settings, model_name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    short = settings.model_copy(update={"api_port": free_port(), "batch_window": 8})
    with running_api(short, tmp_path_factory.mktemp("batches-expiry-logs")) as url:
        client = sdk(url, "unused")
        created = client.batches.create(
            input_file_id=upload(client, long_lines(model_name, 200, max_tokens=16)),
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        assert created.expires_at == created.created_at + 8
        batch = wait_status(client, created.id, "expired", timeout=120)
        assert batch.expired_at is not None and batch.expired_at >= created.expires_at, batch
        outputs, errors = assert_each_line_once(client, batch, 200, "batch_expired")
        assert outputs and errors
        assert client.batches.cancel(created.id).status == "expired"  # an ended batch stays as it ended


def test_a_batchs_end_sends_openais_signed_webhook(
    stack: str, settings: Settings, model_name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    receiver = Receiver()
    server = serve(receiver, timeout=5)
    hooked = settings.model_copy(
        update={
            "api_port": free_port(),
            "webhook_urls": f"http://127.0.0.1:{server.server_address[1]}/hook",
            "webhook_secret": SecretStr(SECRET),
        }
    )
    logs = tmp_path_factory.mktemp("batches-webhook-logs")
    with (
        open(logs / "webhooks.log", "wb") as out,
        subprocess.Popen(webhooks_command(hooked), env=_env(hooked), cwd=ROOT, stdout=out, stderr=out) as sender,
    ):
        try:
            with running_api(hooked, logs) as url:
                client = sdk(url, "unused")
                good = upload(client, [chat_line("a", model_name)])
                kept = client.batches.create(
                    input_file_id=good, endpoint="/v1/chat/completions", completion_window="24h"
                )
                client.batches.cancel(kept.id)
                bad = upload(client, ["not json"])
                failed = client.batches.create(
                    input_file_id=bad, endpoint="/v1/chat/completions", completion_window="24h"
                )
                assert settle(client, failed.id).status == "failed"
                ran = client.batches.create(
                    input_file_id=good, endpoint="/v1/chat/completions", completion_window="24h"
                )
                [cancelled_hook] = receiver.wait(kept.id)
                [failed_hook] = receiver.wait(failed.id)
                [completed_hook] = receiver.wait(ran.id)
        finally:
            sender.terminate()
            server.shutdown()
    assert (cancelled_hook.type, failed_hook.type) == ("batch.cancelled", "batch.failed")
    assert completed_hook.type == "batch.completed"
    assert receiver.unverified == []


def test_metrics_count_batches_by_status_and_their_lines(base: str, model_name: str) -> None:
    def counts() -> dict[str, float]:
        text = httpx.get(f"{base}/metrics").text
        found = re.findall(r'^chatq:batch(es|_lines_total)\{status="(\w+)"\} (\S+)$', text, re.M)
        return {("lines:" if kind != "es" else "") + status: float(value) for kind, status, value in found}

    before = counts()
    assert set(before) == {
        "validating",
        "failed",
        "in_progress",
        "finalizing",
        "completed",
        "expired",
        "cancelling",
        "cancelled",
        "lines:completed",
        "lines:failed",
    }
    client = sdk(base)
    lines = [chat_line("a", model_name), chat_line("b", model_name, max_tokens=10**6)]
    batch = run_batch(client, lines)
    assert batch.status == "completed"
    cancelled = client.batches.create(
        input_file_id=upload(client, [chat_line("a", model_name)]),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    client.batches.cancel(cancelled.id)
    ended = wait_status(client, cancelled.id, "cancelled", "completed", timeout=60).status
    after = counts()
    assert after["completed"] == before["completed"] + 1 + (ended == "completed")
    assert after["cancelled"] == before["cancelled"] + (ended == "cancelled")
    assert (after["validating"], after["in_progress"]) == (before["validating"], before["in_progress"])
    assert after["lines:completed"] >= before["lines:completed"] + 1
    assert after["lines:failed"] >= before["lines:failed"] + 1


def test_a_batch_left_validating_by_a_stopped_api_is_checked_when_read(
    base: str, model_name: str, r: redis.Redis
) -> None:
    client = sdk(base)
    file_id = upload(client, [chat_line("a", model_name), chat_line("b", model_name)])
    # The record as an API writes it before it starts checking the lines, the check never run.
    now = int(time.time())
    orphan = Batch(
        id=new_id(),
        owner=key_hash(KEY_A),
        endpoint="/v1/chat/completions",
        input_file_id=file_id,
        completion_window="24h",
        created_at=now,
        expires_at=now + 86400,
    )
    create(r, orphan, time.time())
    assert r.hget(keys.batch(orphan.id), "status") == "validating"
    batch = settle(client, orphan.id)
    assert batch.status != "failed" and batch.request_counts is not None and batch.request_counts.total == 2
    assert wait_status(client, orphan.id, "completed").request_counts.completed == 2


def test_a_line_whose_answer_redis_lost_runs_again_and_is_answered_once(
    base: str, model_name: str, r: redis.Redis
) -> None:
    client = sdk(base)
    created = client.batches.create(
        input_file_id=upload(client, long_lines(model_name, 40, max_tokens=32)),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    deadline = time.time() + 300
    while not (answered := r.hkeys(keys.batch_results(created.id))):
        assert time.time() < deadline
        time.sleep(0.05)
    lost = answered[0]
    # What a Redis that restarted without its last second of writes would hold: that line neither answered nor
    # counted, its release kept.
    pipe = r.pipeline(transaction=True)
    pipe.hdel(keys.batch_results(created.id), lost)
    pipe.hincrby(keys.batch(created.id), "completed", -1)
    assert pipe.execute()[0] == 1
    batch = wait_status(client, created.id, "completed", "failed", "cancelled", "expired")
    assert batch.status == "completed", batch
    outputs, errors = assert_each_line_once(client, batch, 40, "")
    assert not errors
