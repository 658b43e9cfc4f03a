"""Webhooks end to end: a real API, generation worker and webhook worker on a real Redis, POSTing to a receiver on
127.0.0.1 that verifies every delivery with the official SDK, answers as each test scripts it, and counts."""

from __future__ import annotations

import base64
import contextlib
import http.server
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import redis
from openai import OpenAI
from redis.backoff import NoBackoff
from redis.retry import Retry

from chatq.cli import api_command, webhooks_command
from chatq.core import keys
from chatq.core.settings import Settings
from chatq.embedded_redis import EmbeddedRedis, free_port
from tests.helpers import Cluster, webhook_env

SECRET = "whsec_" + base64.b64encode(b"chatq-test-webhook-secret-32byte").decode()
PROMPT = [{"role": "user", "content": "Say hello."}]


@dataclass
class Delivery:
    webhook_id: str
    type: str
    job_id: str
    answered: int | str


@dataclass
class Receiver:
    """What it answers each job's attempts in turn ("slow": later than the sender waits; the last answer repeats),
    and every delivery it verified. Unverifiable deliveries are kept apart: none is expected."""

    plans: dict[str, list[int | str]] = field(default_factory=dict)
    got: list[Delivery] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, body: bytes, headers: dict[str, str]) -> int | str:
        try:
            event = OpenAI(api_key="unused").webhooks.unwrap(body, headers, secret=SECRET)
        except Exception as e:  # any failure to verify or parse is the test's finding
            with self.lock:
                self.unverified.append(repr(e))
            return 400
        with self.lock:
            plan = self.plans.get(event.data.id, [200])
            answer = plan.pop(0) if len(plan) > 1 else plan[0]
            self.got.append(Delivery(headers["webhook-id"], event.type, event.data.id, answer))
        return answer

    def of(self, job_id: str) -> list[Delivery]:
        with self.lock:
            return [d for d in self.got if d.job_id == job_id]

    def wait(self, job_id: str, delivered: int = 1, timeout: float = 60) -> list[Delivery]:
        """The job's deliveries once `delivered` of them were answered 2xx."""
        deadline = time.time() + timeout
        while sum(d.answered == 200 for d in self.of(job_id)) < delivered:
            assert time.time() < deadline, f"no webhook for {job_id}: {self.of(job_id)} {self.unverified}"
            time.sleep(0.05)
        return self.of(job_id)


def serve(receiver: Receiver, timeout: float) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802  (http.server's name)
            body = self.rfile.read(int(self.headers["content-length"]))
            answer = receiver.answer(body, {k.lower(): v for k, v in self.headers.items()})
            if answer == "slow":
                time.sleep(timeout * 2)
                answer = 200
            self.send_response(int(answer))
            self.end_headers()

        def log_message(self, *_args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@dataclass
class Stack:
    cluster: Cluster
    server: EmbeddedRedis
    receiver: Receiver
    http: httpx.Client

    def submit(self, path: str = "/v1/chat/completions", background: bool = True, **fields) -> str:
        request_id = uuid.uuid4().hex
        prefix = "chatcmpl-" if path.endswith("chat/completions") else "cmpl-"
        body = {"max_tokens": 4, "temperature": 0, "background": background, "request_id": request_id, **fields}
        body |= {"messages": PROMPT} if prefix == "chatcmpl-" else {"prompt": "Hello"}
        resp = self.http.post(path, json=body)
        assert resp.status_code == (202 if background else 200), resp.text
        return resp.json()["id"]

    def start_webhooks(self) -> None:
        self.cluster.start("webhooks", webhooks_command(self.cluster.settings), webhook_env(self.cluster.settings))


@pytest.fixture(scope="module")
def hooked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    receiver = Receiver()
    timeout = 1.0
    receiving = serve(receiver, timeout)
    server = EmbeddedRedis(tmp_path_factory.mktemp("webhook-redis"), persist=True).start()
    settings = Settings(
        redis_url=server.url,
        api_port=free_port(),
        webhook_urls=f"http://127.0.0.1:{receiving.server_address[1]}/hooks",
        webhook_secret=SECRET,
        webhook_timeout=timeout,
        webhook_backoff=0.2,
        webhook_backoff_max=1.0,
        webhook_retry_for=120,
    )
    cluster = Cluster(settings, tmp_path_factory.mktemp("webhook-logs"))
    env = webhook_env(settings)
    s: Stack | None = None
    try:
        cluster.start("api", api_command(settings), env)
        cluster.wait_live(cluster.start_worker(**env))
        with httpx.Client(base_url=f"http://127.0.0.1:{settings.api_port}", timeout=120) as client:
            s = Stack(cluster, server, receiver, client)
            s.start_webhooks()
            wait_healthy(client, cluster)
            yield s
    finally:
        cluster.stop_all()
        (s.server if s is not None else server).stop()  # the one a test restarted, if any
        receiving.shutdown()


def wait_healthy(client: httpx.Client, cluster: Cluster) -> None:
    deadline = time.time() + 60
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if client.get("/health").status_code == 200:
                return
        assert time.time() < deadline, cluster.tail("api")
        time.sleep(0.2)


@pytest.mark.parametrize(
    ("path", "type_"),
    [("/v1/chat/completions", "chat.completion.completed"), ("/v1/completions", "text_completion.completed")],
)
def test_a_background_job_sends_one_verified_event_again_after_a_5xx(hooked: Stack, path: str, type_: str) -> None:
    job_id = f"{'chatcmpl' if 'chat' in path else 'cmpl'}-{uuid.uuid4().hex}"
    hooked.receiver.plans[job_id] = [500, 200]
    assert hooked.submit(path, request_id=job_id.split("-", 1)[1]) == job_id
    got = hooked.receiver.wait(job_id)
    time.sleep(1.5)  # longer than the backoff: a delivery answered 200 is not sent again
    got = hooked.receiver.of(job_id)
    assert [d.answered for d in got] == [500, 200]
    assert {d.type for d in got} == {type_} and len({d.webhook_id for d in got}) == 1
    assert got[0].webhook_id.startswith("evt_")
    assert not hooked.receiver.unverified


def test_a_background_response_sends_the_event_of_its_status(hooked: Stack) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "input": "Tell me a long story.", "background": True}
    short = hooked.http.post("/v1/responses", json=body | {"max_output_tokens": 3, "temperature": 0}).json()["id"]
    (got,) = hooked.receiver.wait(short)
    assert got.type == "response.incomplete"  # it ran out of tokens
    deadline = time.time() + 30
    while hooked.http.get(f"/v1/responses/{short}").json()["status"] != "incomplete":
        assert time.time() < deadline
        time.sleep(0.05)


def test_a_slow_receiver_is_timed_out_and_sent_the_same_event_again(hooked: Stack) -> None:
    job_id = "chatcmpl-" + uuid.uuid4().hex
    hooked.receiver.plans[job_id] = ["slow", 200]
    hooked.submit(request_id=job_id.removeprefix("chatcmpl-"))
    got = hooked.receiver.wait(job_id)
    assert [d.answered for d in got] == ["slow", 200] and len({d.webhook_id for d in got}) == 1


def test_a_4xx_is_not_sent_again_but_429_is(hooked: Stack) -> None:
    refused, limited = "chatcmpl-" + uuid.uuid4().hex, "chatcmpl-" + uuid.uuid4().hex
    hooked.receiver.plans[refused] = [400]
    hooked.receiver.plans[limited] = [429, 200]
    for job_id in (refused, limited):
        hooked.submit(request_id=job_id.removeprefix("chatcmpl-"))
    hooked.receiver.wait(limited)
    deadline = time.time() + 30
    while not hooked.receiver.of(refused):
        assert time.time() < deadline
        time.sleep(0.05)
    time.sleep(2)  # several backoffs
    assert [d.answered for d in hooked.receiver.of(refused)] == [400]


def test_an_interactive_job_sends_no_webhook(hooked: Stack) -> None:
    interactive = hooked.submit(background=False)
    after = hooked.submit()  # delivered once the interactive one's, had it sent any, would have been
    hooked.receiver.wait(after)
    time.sleep(0.5)
    assert hooked.receiver.of(interactive) == []


def test_a_queued_job_cancelled_sends_its_cancelled_event(hooked: Stack) -> None:
    worker = next(iter(hooked.cluster.models))
    hooked.cluster.signal(worker, signal.SIGSTOP)  # nothing claims the job meanwhile
    try:
        job_id = hooked.submit()
        resp = hooked.http.post(f"/v1/chat/completions/{job_id}/cancel")
        assert resp.status_code == 200 and resp.json()["status"] == "cancelled", resp.text
    finally:
        hooked.cluster.signal(worker, signal.SIGCONT)
    got = hooked.receiver.wait(job_id)
    assert [d.type for d in got] == ["chat.completion.cancelled"]


def test_a_delivery_pending_when_the_webhook_worker_is_killed_is_made_by_its_successor(hooked: Stack) -> None:
    job_id = "chatcmpl-" + uuid.uuid4().hex
    hooked.receiver.plans[job_id] = [503]
    hooked.submit(request_id=job_id.removeprefix("chatcmpl-"))
    deadline = time.time() + 60
    while not hooked.receiver.of(job_id):
        assert time.time() < deadline, hooked.cluster.tail("webhooks")
        time.sleep(0.05)
    hooked.cluster.signal("webhooks", signal.SIGKILL)
    hooked.cluster.procs["webhooks"].wait(timeout=10)
    hooked.receiver.plans[job_id] = [200]
    failed = len(hooked.receiver.of(job_id))
    hooked.start_webhooks()
    got = hooked.receiver.wait(job_id, timeout=90)
    assert all(d.answered == 503 for d in got[:failed]) and got[-1].answered == 200
    assert len({d.webhook_id for d in got}) == 1


def test_an_undelivered_event_outlives_a_redis_restart(hooked: Stack) -> None:
    hooked.cluster.signal("webhooks", signal.SIGTERM)
    hooked.cluster.procs["webhooks"].wait(timeout=30)
    job_id = hooked.submit()
    r = redis.Redis.from_url(hooked.cluster.settings.redis_url, retry=Retry(NoBackoff(), 0))
    deadline = time.time() + 60
    while not r.llen(keys.webhook_queue()):
        assert time.time() < deadline, "the job's end pushed no webhook"
        time.sleep(0.05)
    with contextlib.suppress(redis.ConnectionError):
        r.shutdown()  # Redis writes its AOF and exits
    assert hooked.server.proc is not None and hooked.server.proc.wait(timeout=20) == 0
    port = hooked.server.port
    hooked.server = EmbeddedRedis(hooked.server.data_dir, port=port, persist=True).start()
    hooked.start_webhooks()
    got = hooked.receiver.wait(job_id, timeout=60)
    assert [d.type for d in got] == ["chat.completion.completed"]


def test_the_event_is_what_openai_sends() -> None:
    from chatq.core.webhooks import thin_event

    event = thin_event("evt_1", "resp_1", 7, "response.incomplete")
    assert event == {
        "id": "evt_1",
        "object": "event",
        "created_at": 7,
        "type": "response.incomplete",
        "data": {"id": "resp_1"},
    }
    assert thin_event("evt_1", "x", 7, "chat.in_progress") is None
