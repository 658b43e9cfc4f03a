"""/v1/batches through the official openai SDK, on an API with keys beside the session's stack (whose worker serves
the model the lines name): a good file goes in progress, each bad line fails the batch naming it, bad create fields
are 400s that create nothing, a cancel ends in `cancelled`, lists page newest first, another key's batch is not
found, and a batch's end sends OpenAI's signed batch.* webhook."""

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
    assert batch.status == "in_progress" and batch.in_progress_at is not None, batch
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
    cancelled = client.batches.cancel(made[0])
    assert cancelled.status == "cancelled", cancelled
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


def test_a_batch_past_its_window_expires(
    stack: str, settings: Settings, model_name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    short = settings.model_copy(update={"api_port": free_port(), "batch_window": 2})
    with running_api(short, tmp_path_factory.mktemp("batches-expiry-logs")) as url:
        client = sdk(url, "unused")
        created = client.batches.create(
            input_file_id=upload(client, [chat_line("a", model_name)]),
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        assert created.expires_at == created.created_at + 2
        assert settle(client, created.id).status == "in_progress"
        time.sleep(max(0.0, created.expires_at - time.time()) + 1)
        batch = client.batches.retrieve(created.id)
        assert batch.status == "expired" and batch.expired_at is not None, batch
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
                [cancelled_hook] = receiver.wait(kept.id)
                [failed_hook] = receiver.wait(failed.id)
        finally:
            sender.terminate()
            server.shutdown()
    assert (cancelled_hook.type, failed_hook.type) == ("batch.cancelled", "batch.failed")
    assert receiver.unverified == []


def test_metrics_count_batches_by_status(base: str, model_name: str) -> None:
    def counts() -> dict[str, float]:
        text = httpx.get(f"{base}/metrics").text
        found = re.findall(r'^chatq:batches\{status="(\w+)"\} (\S+)$', text, re.M)
        return {status: float(value) for status, value in found}

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
    }
    client = sdk(base)
    batch = client.batches.create(
        input_file_id=upload(client, [chat_line("a", model_name)]),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    settle(client, batch.id)
    client.batches.cancel(batch.id)
    after = counts()
    assert after["cancelled"] == before["cancelled"] + 1
    assert (after["validating"], after["in_progress"]) == (before["validating"], before["in_progress"])


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
    assert batch.status == "in_progress" and batch.request_counts is not None and batch.request_counts.total == 2
