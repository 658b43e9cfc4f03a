"""CHATQ_ENGINE=vllm: workers whose generate stage is vLLM's engine (its CPU build, run from .venv-vllm), with chatq's
API, queue, streams and recovery around them, on the default model. Answers are compared with the native engine's,
from the session's stack."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chatq.cli import api_command
from chatq.core import keys
from chatq.core.settings import Settings
from chatq.embedded_redis import EmbeddedRedis, free_port
from tests.helpers import (
    ROOT,
    UNPENALISED,
    Cluster,
    Frame,
    content_of,
    frames,
    model_info,
    stream,
    vllm_venv,
    wait_for,
)

PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}]
# Eager steps: a CPU worker then starts in seconds, not after a minute of compiling.
VLLM_WORKER = {
    "CHATQ_ENGINE": "vllm",
    "CHATQ_KV_CACHE_TOKENS": "16384",
    "CHATQ_VLLM_ARGS": '{"enforce_eager": true}',
    "CHATQ_OVERRIDE_GENERATION_CONFIG": json.dumps(UNPENALISED),  # as the native stack it is compared with
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "keeper": {"type": "boolean"}},
    "required": ["name", "keeper"],
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    venv = vllm_venv()
    server = EmbeddedRedis(tmp_path_factory.mktemp("vllm-redis"), persist=False).start()
    settings = Settings(
        redis_url=server.url,
        api_port=free_port(),
        worker_ttl=3,
        stop_grace=2,
        max_attempts=2,
        worker_metrics_port=free_port(),
        log_format="json",  # the workers' commands then leave Celery's banner out
    )
    c = Cluster(settings, tmp_path_factory.mktemp("vllm-logs"))
    try:
        c.start("api", api_command(settings))
        metrics = {"CHATQ_WORKER_METRICS_PORT": str(settings.worker_metrics_port)}
        # The second logs JSON lines, vLLM's among them; TORCH_CPP_LOG_LEVEL keeps out the one line vLLM's C++ writes.
        json_logs = {"CHATQ_LOG_FORMAT": "json", "TORCH_CPP_LOG_LEVEL": "ERROR"}
        c.wait_live(
            c.start_worker(venv=venv, **VLLM_WORKER, **metrics), c.start_worker(venv=venv, **VLLM_WORKER, **json_logs)
        )
        yield c
    finally:
        c.stop_all()
        server.stop()


@pytest.fixture(scope="module")
def api(cluster: Cluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{cluster.settings.api_port}", timeout=120) as client:
        yield client


def greedy(max_tokens: int = 24, **fields) -> dict:
    return {"messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, **fields}


def chat(client: httpx.Client, body: dict) -> dict:
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_the_engine_adapters_own_tests_pass_in_the_vllm_venv():
    venv = vllm_venv()
    command = [
        str(venv / "bin/python"),
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/worker/test_vllm_engine.py",
    ]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


def test_a_vllm_worker_registers_its_engine_and_counts_its_tokens(cluster: Cluster, api: httpx.Client):
    entries = [cluster.r.hgetall(k) for k in cluster.r.scan_iter(keys.worker("*"))]
    assert len(entries) == 2 and {(e["mode"], e["device"], e["checks"]) for e in entries} == {("vllm", "cpu", "[]")}
    # Two workers take the queue's jobs: the one whose metrics are read made a job's tokens after a few tries.
    for _ in range(8):
        before = scrape(cluster.settings)
        usage = chat(api, greedy(4))["usage"]
        after = scrape(cluster.settings)
        made = after["chatq:engine_generation_tokens_total"] - before["chatq:engine_generation_tokens_total"]
        if made:
            break
    assert made == usage["completion_tokens"] == 4
    assert after["chatq:engine_steps_total"] - before["chatq:engine_steps_total"] >= 4
    assert after["chatq:prefix_cache_queries_total"] - before["chatq:prefix_cache_queries_total"] > 0
    assert after["chatq:kv_cache_num_blocks"] > 0 and after["chatq:engine_mode"] == 1.0


def test_a_vllm_workers_json_log_holds_vllms_lines_as_json(cluster: Cluster):
    lines = (cluster.logs / "w2.log").read_text().splitlines()
    loggers = {json.loads(line)["logger"] for line in lines}  # each line is one JSON object
    assert "chatq.worker.build" in loggers and any(name.startswith("vllm.") for name in loggers), loggers


def scrape(settings: Settings) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{settings.worker_metrics_port}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("mode") in (None, "vllm") and "le" not in s.labels:
                samples[s.name] = s.value
    return samples


def test_greedy_answers_streamed_or_not_are_the_native_engines(api: httpx.Client, http: httpx.Client):
    answer = chat(api, greedy())
    streamed = stream(api, "POST", "/v1/chat/completions", json=greedy(stream=True))
    text = answer["choices"][0]["message"]["content"]
    assert content_of(streamed) == text and answer["choices"][0]["finish_reason"] == "length"
    assert streamed[-1].data == "[DONE]"
    native = chat(http, greedy())
    assert native["choices"][0]["message"]["content"] == text
    # The counts; cached_tokens is what each engine's own prefix cache held.
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [native["usage"][k] for k in counts] == [answer["usage"][k] for k in counts]


def test_legacy_completions_and_logprobs_are_the_native_engines(api: httpx.Client, http: httpx.Client):
    body = {"prompt": "The lighthouse keeper", "max_tokens": 8, "temperature": 0, "logprobs": 2}
    got, want = (c.post("/v1/completions", json=body).json()["choices"][0] for c in (api, http))
    assert got["text"] == want["text"] and got["finish_reason"] == "length"
    assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-3)
    for top, native in zip(got["logprobs"]["top_logprobs"], want["logprobs"]["top_logprobs"], strict=True):
        assert list(top) == list(native) and list(top.values()) == pytest.approx(list(native.values()), abs=1e-3)
    chat_logprobs = chat(api, greedy(4, logprobs=True, top_logprobs=2))["choices"][0]["logprobs"]["content"]
    assert len(chat_logprobs) == 4 and all(len(t["top_logprobs"]) == 2 for t in chat_logprobs)
    # Greedy: each token is its position's most likely.
    assert all(t["token"] == t["top_logprobs"][0]["token"] for t in chat_logprobs)


def test_stop_strings_and_stop_token_ids_end_the_answer_as_on_the_native_engine(api: httpx.Client, http: httpx.Client):
    text = chat(api, greedy())["choices"][0]["message"]["content"]
    word = text.split()[4]
    by_string = chat(api, greedy(stop=[f" {word}"]))["choices"][0]
    assert by_string["message"]["content"] == text[: text.index(f" {word}")]
    assert (by_string["finish_reason"], by_string["stop_reason"]) == ("stop", f" {word}")
    ids = model_info().tokenizer.encode(text, add_special_tokens=False).ids
    by_id = chat(api, greedy(stop_token_ids=[ids[3]]))["choices"][0]
    assert (by_id["finish_reason"], by_id["stop_reason"]) == ("stop", ids[3])
    assert by_id == chat(http, greedy(stop_token_ids=[ids[3]]))["choices"][0]


def test_n_choices_are_seeded_apart_and_again_alike(api: httpx.Client):
    body = {"messages": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2}
    first, again = (chat(api, body)["choices"] for _ in range(2))
    assert [c["index"] for c in first] == [0, 1] and all(c["finish_reason"] == "length" for c in first)
    texts = [c["message"]["content"] for c in first]
    assert texts[0] != texts[1] and texts == [c["message"]["content"] for c in again]


def test_a_json_schema_answer_follows_it_as_on_the_native_engine(api: httpx.Client, http: httpx.Client):
    body = greedy(60, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    choice = chat(api, body)["choices"][0]
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    assert choice["finish_reason"] == "stop" and choice == chat(http, body)["choices"][0]


def test_a_background_job_is_polled_to_its_end(api: httpx.Client):
    resp = api.post("/v1/chat/completions", json=greedy(8, background=True))
    assert resp.status_code == 202, resp.text
    job = wait_for(api, resp.json()["id"], lambda j: j["status"] not in ("queued", "in_progress"))
    assert job["status"] == "completed"
    assert job["choices"][0]["message"]["content"] == chat(api, greedy(8))["choices"][0]["message"]["content"]


def test_a_running_job_is_cancelled(api: httpx.Client):
    resp = api.post("/v1/chat/completions", json=greedy(2000, background=True, ignore_eos=True))
    job_id = resp.json()["id"]
    at = wait_for(api, job_id, lambda j: j["progress"]["completion_tokens"] >= 3)["progress"]["completion_tokens"]
    assert api.post(f"/v1/chat/completions/{job_id}/cancel").status_code == 200
    job = wait_for(api, job_id, lambda j: j["status"] != "in_progress", timeout=60)
    assert job["status"] == "cancelled" and job["progress"]["completion_tokens"] - at <= 10
    fs = stream(api, "GET", f"/v1/chat/completions/{job_id}", params={"stream": "true"})
    assert fs[-1].data == "[DONE]" and fs[-2].json["choices"][0]["finish_reason"] == "abort"


def test_a_killed_vllm_workers_job_continues_on_another_with_no_gap_or_repeat(cluster: Cluster, api: httpx.Client):
    expected = chat(api, greedy(48, ignore_eos=True))["choices"][0]["message"]["content"]
    got: list[Frame] = []
    killed = ""
    with api.stream("POST", "/v1/chat/completions", json=greedy(48, ignore_eos=True, stream=True)) as resp:
        for frame in frames(resp.iter_lines()):
            got.append(frame)
            if len(got) == 12:
                killed = cluster.holder(got[0].json["id"])
                cluster.signal(killed, signal.SIGKILL)
    assert [f.id for f in got] == list(range(1, len(got) + 1)) and got[-1].data == "[DONE]"
    assert content_of(got) == expected
    job_id = got[0].json["id"]
    assert cluster.r.hget(keys.job(job_id), "attempts") == "2"
    assert cluster.r.hget(keys.job(job_id), "worker").split("@")[0] != killed
    assert api.get(f"/v1/chat/completions/{job_id}").json()["choices"][0]["message"]["content"] == expected
