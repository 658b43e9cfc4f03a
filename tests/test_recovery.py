"""A worker's death loses nothing: real worker processes killed (SIGKILL) or stopped (SIGTERM) mid-job, on a Redis and
an API of this module's own. The job continues on another worker from its last published event."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from bench import soak
from chatq.cli import api_command
from chatq.core import adapters, keys, lora_format, metrics
from chatq.core.settings import Settings
from chatq.embedded_redis import EmbeddedRedis, free_port
from tests.helpers import Cluster, Frame, frames, make_adapter

PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("recovery-redis"), persist=False).start()
    settings = Settings(
        redis_url=server.url, api_port=free_port(), worker_ttl=3, stop_grace=2, max_attempts=2, result_ttl=15
    )
    c = Cluster(settings, tmp_path_factory.mktemp("recovery-logs"))
    try:
        c.start("api", api_command(settings))
        c.wait_live(c.start_worker(), c.start_worker())
        yield c
    finally:
        c.stop_all()
        server.stop()


@pytest.fixture(scope="module")
def http(cluster: Cluster) -> Iterator[httpx.Client]:
    base = f"http://{cluster.settings.api_host}:{cluster.settings.api_port}"
    with httpx.Client(base_url=base, timeout=120) as client:
        deadline = time.time() + 60
        while True:
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, cluster.tail("api")
            time.sleep(0.2)
        yield client


def body(max_tokens: int, **fields) -> dict:
    return {"messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **fields}


def answer(http: httpx.Client, max_tokens: int) -> str:
    """The uninterrupted greedy answer."""
    resp = http.post("/v1/chat/completions", json=body(max_tokens))
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def text_of(fs: list[Frame]) -> str:
    return "".join(c["delta"].get("content") or "" for f in fs if f.data[0] == "{" for c in f.json.get("choices", []))


def assert_whole(fs: list[Frame]) -> None:
    """Every event once, in order, and the stream ended."""
    assert [f.id for f in fs] == list(range(1, len(fs) + 1))
    assert fs[-1].data == "[DONE]"


def stream_signalling(
    cluster: Cluster, http: httpx.Client, request: dict, at: int, *sigs: int, path: str = "/v1/chat/completions"
) -> tuple[list[Frame], str]:
    """The frames of a streamed request whose worker gets `sigs` once the stream carried `at` events; that worker."""
    got: list[Frame] = []
    holder = ""
    with http.stream("POST", path, json=request, timeout=httpx.Timeout(120, read=90)) as resp:
        assert resp.status_code == 200, resp.read()
        for frame in frames(resp.iter_lines()):
            got.append(frame)
            if len(got) == at:
                holder = cluster.holder(got[0].json["id"])
                for sig in sigs:
                    cluster.signal(holder, sig)
                    time.sleep(0.2)
    return got, holder


def finished_by(cluster: Cluster, job_id: str) -> str:
    return cluster.r.hget(keys.job(job_id), "worker").split("@")[0]


def counted(cluster: Cluster) -> tuple[float, float, float]:
    """Of the model's metrics: jobs with an end-to-end time, jobs with a time to first token, tokens generated."""
    reading = metrics.read(cluster.r.hgetall(keys.metrics(cluster.settings.model_name)))
    e2e, ttft = (reading.histograms[h.name].buckets[-1][1] for h in (metrics.E2E, metrics.TTFT))
    return e2e, ttft, reading.generation_tokens


def test_a_job_whose_worker_is_killed_continues_on_another_with_no_gap_or_repeat(cluster, http):
    before = counted(cluster)
    expected = answer(http, 120)
    fs, killed = stream_signalling(cluster, http, body(120, stream=True), 20, signal.SIGKILL)
    assert_whole(fs)
    assert text_of(fs) == expected
    job_id = fs[0].json["id"]
    assert http.get(f"/v1/chat/completions/{job_id}").json()["choices"][0]["message"]["content"] == expected
    assert cluster.r.hget(keys.job(job_id), "attempts") == "2" and finished_by(cluster, job_id) != killed
    # Counted once, by the worker that ended it; its first token went out from the killed one, uncounted.
    assert [a - b for a, b in zip(counted(cluster), before, strict=True)] == [2, 1, 240]
    # The dead worker's Celery message went with the reclaim: nothing is left to be delivered again hours later.
    deadline = time.time() + 10
    while cluster.r.hlen(keys.KOMBU_UNACKED):
        assert time.time() < deadline, cluster.r.hgetall(keys.KOMBU_UNACKED)
        time.sleep(0.1)
    cluster.wait_live(cluster.start_worker())


def test_a_response_whose_worker_is_killed_continues_on_another(cluster, http):
    client = openai.OpenAI(
        base_url=f"{str(http.base_url).rstrip('/')}/v1", api_key="unused", max_retries=0, timeout=120
    )
    story = "Tell me a long story about a lighthouse keeper and the sea."
    expected = client.responses.create(input=story, max_output_tokens=80, temperature=0).output_text
    events, killed = [], ""
    for event in client.responses.create(input=story, max_output_tokens=80, temperature=0, stream=True):
        events.append(event)
        if len(events) == 20:
            killed = cluster.holder(events[0].response.id)
            cluster.signal(killed, signal.SIGKILL)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == expected and events[-1].response.output_text == expected
    job_id = events[0].response.id
    assert cluster.r.hget(keys.job(job_id), "attempts") == "2" and finished_by(cluster, job_id) != killed
    cluster.wait_live(cluster.start_worker())


def test_a_scored_batch_whose_worker_is_killed_gives_the_same_answer(cluster, http):
    prompts = ["The lighthouse keeper looked at the sea and", "Once upon a time, in a village by the sea,"]
    request = {"prompt": prompts, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 1}
    expected = http.post("/v1/completions", json=request).json()["choices"]
    fs, killed = stream_signalling(
        cluster, http, {**request, "stream": True}, 20, signal.SIGKILL, path="/v1/completions"
    )
    assert_whole(fs)
    job_id = fs[0].json["id"]
    assert cluster.r.hget(keys.job(job_id), "attempts") == "2" and finished_by(cluster, job_id) != killed
    result = http.get(f"/v1/chat/completions/{job_id}").json()["choices"]
    for whole, got in zip(expected, result, strict=True):
        streamed = [c for f in fs[:-1] for c in f.json["choices"] if c["index"] == whole["index"]]
        assert "".join(c["text"] for c in streamed) == got["text"] == whole["text"]
        tokens = [t for c in streamed if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert tokens == got["logprobs"]["tokens"] == whole["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"][0] is None
        assert got["logprobs"]["token_logprobs"][1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=1e-4)
    cluster.wait_live(cluster.start_worker())


def test_a_filtered_job_whose_worker_is_killed_continues_with_the_same_filters(cluster, http):
    """bad_words, named logprob ids and token ids hold across the takeover: the continued job answers as one that ran
    whole."""
    fields = {
        "bad_words": [" sea", " keeper"],
        "logprobs": True,
        "logprob_token_ids": [13, 198],
        "return_token_ids": True,
    }
    resp = http.post("/v1/chat/completions", json=body(80, **fields))
    assert resp.status_code == 200, resp.text
    whole = resp.json()["choices"][0]
    assert " sea" not in whole["message"]["content"] and " keeper" not in whole["message"]["content"]
    fs, killed = stream_signalling(cluster, http, body(80, stream=True, **fields), 20, signal.SIGKILL)
    assert_whole(fs)
    assert text_of(fs) == whole["message"]["content"]
    streamed = [c for f in fs if f.data[0] == "{" for c in f.json.get("choices", [])]
    assert [t for c in streamed for t in c.get("token_ids") or []] == whole["token_ids"]
    named = [
        [e["token"] for e in t["top_logprobs"]] for c in streamed if c.get("logprobs") for t in c["logprobs"]["content"]
    ]
    assert named == [[e["token"] for e in t["top_logprobs"]] for t in whole["logprobs"]["content"]]
    job_id = fs[0].json["id"]
    assert cluster.r.hget(keys.job(job_id), "attempts") == "2" and finished_by(cluster, job_id) != killed
    cluster.wait_live(cluster.start_worker())


def test_a_job_under_an_adapter_whose_worker_is_killed_continues_with_it(cluster, http, tmp_path):
    path = str(make_adapter(tmp_path / "adapter", rank=8, seed=5))
    model = cluster.settings.model_name
    adapters.add_at_start(cluster.r, adapters.record("steady", model, path, lora_format.read_config(path)))
    deadline = time.time() + 10
    while "steady" not in [m["id"] for m in http.get("/v1/models").json()["data"]]:
        assert time.time() < deadline
        time.sleep(0.2)
    resp = http.post("/v1/chat/completions", json=body(100, model="steady"))
    assert resp.status_code == 200, resp.text
    expected = resp.json()["choices"][0]["message"]["content"]
    assert expected != answer(http, 100), "the adapter changes the answer"
    fs, killed = stream_signalling(cluster, http, body(100, stream=True, model="steady"), 20, signal.SIGKILL)
    assert_whole(fs)
    assert text_of(fs) == expected
    assert {f.json["model"] for f in fs if f.data[0] == "{"} == {"steady"}
    job_id = fs[0].json["id"]
    assert cluster.r.hget(keys.job(job_id), "attempts") == "2" and finished_by(cluster, job_id) != killed
    cluster.r.hdel(keys.adapters(), "steady")
    cluster.wait_live(cluster.start_worker())


def background(http: httpx.Client, max_tokens: int, **fields) -> str:
    resp = http.post("/v1/chat/completions", json=body(max_tokens, background=True, **fields))
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


def wait_status(http: httpx.Client, job_id: str, *statuses: str, tokens: int = 0) -> dict:
    deadline = time.time() + 120
    while True:
        job = http.get(f"/v1/chat/completions/{job_id}").json()
        if job["status"] in statuses and job["progress"]["completion_tokens"] >= tokens:
            return job
        assert time.time() < deadline, f"job {job_id} stuck: {job}"
        time.sleep(0.05)


def replay(http: httpx.Client, job_id: str) -> list[Frame]:
    with http.stream("GET", f"/v1/chat/completions/{job_id}?stream=true") as resp:
        assert resp.status_code == 200
        return list(frames(resp.iter_lines()))


def new_holder(cluster: Cluster, job_id: str, old: str) -> str:
    deadline = time.time() + 120
    while (holder := cluster.holder(job_id)) == old or cluster.r.hget(keys.job(job_id), "status") != "in_progress":
        assert time.time() < deadline, f"no other worker took {job_id} over"
        time.sleep(0.05)
    return holder


def test_a_job_whose_workers_keep_dying_fails_once_its_attempts_are_spent(cluster, http):
    job_id = background(http, 4000)  # still running after the workers below start
    wait_status(http, job_id, "in_progress", tokens=5)
    first = cluster.holder(job_id)
    cluster.signal(first, signal.SIGKILL)
    second = new_holder(cluster, job_id, first)
    tokens = wait_status(http, job_id, "in_progress")["progress"]["completion_tokens"]
    wait_status(http, job_id, "in_progress", tokens=tokens + 5)
    # Live workers to sweep for it at once: a job nobody sweeps for longer than its log's expiry (result_ttl, 15 s
    # here) loses the log.
    cluster.wait_live(cluster.start_worker(), cluster.start_worker())
    cluster.signal(second, signal.SIGKILL)
    job = wait_status(http, job_id, "failed")
    assert "CHATQ_MAX_ATTEMPTS" in job["error"]["message"]
    fs = replay(http, job_id)
    assert_whole(fs)
    assert "CHATQ_MAX_ATTEMPTS" in fs[-2].json["error"]["message"]
    assert len(text_of(fs)) > 0  # what the attempts streamed stays in the log, before the error


def test_a_beam_search_whose_worker_is_killed_answers_the_same_on_another(cluster, http):
    beams = {"n": 2, "use_beam_search": True}
    resp = http.post("/v1/chat/completions", json=body(60, **beams))
    assert resp.status_code == 200, resp.text
    expected = [c["message"] for c in resp.json()["choices"]]
    job_id = background(http, 60, **beams)
    wait_status(http, job_id, "in_progress")
    killed = cluster.holder(job_id)
    time.sleep(1)  # the search is under way: a beam search publishes nothing before its end
    cluster.signal(killed, signal.SIGKILL)
    job = wait_status(http, job_id, "completed")
    assert [c["message"] for c in job["choices"]] == expected
    assert cluster.r.hget(keys.job(job_id), "attempts") == "2" and finished_by(cluster, job_id) != killed
    assert_whole(replay(http, job_id))
    cluster.wait_live(cluster.start_worker())


def running_on(cluster: Cluster, http: httpx.Client, worker: str, max_tokens: int, model: str) -> str:
    """A background job that `worker` is generating; those submitted on the way, which others took, run there."""
    for _ in range(20):
        job_id = background(http, max_tokens, model=model)
        if cluster.holder(job_id) == worker:
            wait_status(http, job_id, "in_progress", "completed", tokens=1)
            if cluster.r.hget(keys.job(job_id), "status") == "in_progress":
                return job_id
    raise AssertionError(f"{worker} took none of 20 jobs")


def test_a_stopped_worker_finishes_what_fits_its_grace_and_hands_the_rest_over(cluster, http):
    # Two workers of a model of their own, with a grace that a short job fits in however slow the machine.
    model = "graceful"
    pair = [
        cluster.start_worker(model, CHATQ_MODEL=str(cluster.settings.model_dir), CHATQ_STOP_GRACE="15") for _ in "ab"
    ]
    cluster.wait_live(*pair)
    try:
        long_id = background(http, 4000, model=model)
        stopped = cluster.holder(long_id)
        wait_status(http, long_id, "in_progress", tokens=5)
        short = running_on(cluster, http, stopped, 4, model)
        cluster.signal(stopped, signal.SIGTERM)
        job = wait_status(http, short, "completed")
        # The short job, running when the signal came, ended there within the grace; the long one moved on.
        assert job["usage"]["completion_tokens"] == 4 and finished_by(cluster, short) == stopped
        assert cluster.r.hget(keys.job(short), "attempts") == "1"
        taker = new_holder(cluster, long_id, stopped)
        assert taker in pair and cluster.r.hget(keys.job(long_id), "attempts") == "1"  # handed over, not counted
        moved_at = wait_status(http, long_id, "in_progress")["progress"]["completion_tokens"]
        wait_status(http, long_id, "in_progress", tokens=moved_at + 5)  # and it goes on there
        assert http.post(f"/v1/chat/completions/{long_id}/cancel").status_code == 200
        fs = replay(http, long_id)
        assert_whole(fs)
        assert text_of(fs) == http.get(f"/v1/chat/completions/{long_id}").json()["choices"][0]["message"]["content"]
        assert cluster.procs[stopped].wait(timeout=60) == 0
    finally:
        for name in pair:
            cluster.procs[name].kill()


def test_a_second_signal_hands_the_jobs_over_at_once(cluster, http):
    # Sampled without a seed: a worker that started the job over, rather than go on from its log, would stream one
    # text and store another.
    request = body(200, stream=True) | {"temperature": 1.0}
    fs, stopped = stream_signalling(cluster, http, request, 10, signal.SIGTERM, signal.SIGTERM)
    assert_whole(fs)
    job_id = fs[0].json["id"]
    assert text_of(fs) == http.get(f"/v1/chat/completions/{job_id}").json()["choices"][0]["message"]["content"]
    assert finished_by(cluster, job_id) != stopped and cluster.r.hget(keys.job(job_id), "attempts") == "1"
    assert cluster.procs[stopped].poll() is not None
    cluster.wait_live(cluster.start_worker())


def test_a_short_soak_with_a_worker_killed_midway_loses_nothing(cluster, http):
    # bench/soak.py at a twentieth of its size: every way of using a job, from many clients at once.
    tally = soak.Tally()

    def kill() -> None:
        cluster.signal(sorted(cluster.live_workers())[0], signal.SIGKILL)
        cluster.start_worker()

    asyncio.run(soak.load(str(http.base_url).rstrip("/"), 50, 10, tally, kill, job_timeout=180))
    assert (tally.lost, tally.broken_logs, tally.server_errors) == ([], [], [])
    assert tally.ended["completed"] > 25 and tally.ended["cancelled"] > 0
    # Once the results expire, nothing of the jobs is left in Redis.
    deadline = time.time() + cluster.settings.result_ttl + 30
    # Registries, counters, usage and the fair share's service outlive the jobs.
    registries = (keys.workers(""), keys.worker(""), keys.models(), keys.model(""))
    models = set(cluster.models.values())
    fair = tuple(k for m in models for k in (keys.fair_service(m), keys.fair_clock(m)))
    kept = (*registries, keys.metrics(""), keys.usage("", "").rstrip(":"), *fair)
    while left := [k for k in cluster.r.scan_iter("chatq:*") if not k.startswith(kept)]:
        assert time.time() < deadline, left
        time.sleep(1)
