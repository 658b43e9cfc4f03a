"""Small helpers the tests share: reading SSE frames, waiting on a job, running a parser over pieces of text."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from chatq.api.jobs import JobStore
from chatq.cli import api_command, webhooks_command, worker_command
from chatq.core import keys
from chatq.core.delta import Delta
from chatq.core.errors import JobNotFound
from chatq.core.model_info import ModelInfo
from chatq.core.queue import make_celery
from chatq.core.redis_url import async_client
from chatq.core.settings import Settings
from chatq.embedded_redis import free_port
from chatq.worker.parse import JoinedDeltas, Parser

ROOT = Path(__file__).resolve().parent.parent
# vLLM's engine (CHATQ_ENGINE=vllm) and its pins, apart from the main venv: `make setup-vllm` makes it.
VLLM_VENV = ROOT / ".venv-vllm"


def model_info(max_model_len: int = 0, eos_token_ids: tuple[int, ...] | None = None) -> ModelInfo:
    """The default model's facts, with its context length and EOS ids as a test needs them."""
    info = _default_model()
    info = dataclasses.replace(info, max_model_len=max_model_len) if max_model_len else info
    return info if eos_token_ids is None else dataclasses.replace(info, eos_token_ids=eos_token_ids)


@functools.cache
def _default_model() -> ModelInfo:
    return ModelInfo.read(Settings().model_name, Settings().model_dir)


TINY_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] | capitalize }}:\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)


def build_tiny_model(target: Path) -> Path:
    """A second model, built here: a two-layer Llama with random weights, the default model's tokenizer, a context of
    2048 and a chat template of its own (TINY_TEMPLATE)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    source = Settings().model_dir
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (target / name).write_bytes((source / name).read_bytes())
    (target / "chat_template.jinja").write_text(TINY_TEMPLATE)
    return target


def make_adapter(target: Path, rank: int = 8, seed: int = 0, base: Path | None = None) -> Path:
    """A PEFT LoRA adapter of the default model (or of the model at `base`) on all seven projections, its A and B
    random and non-zero (a fresh adapter's B is zero: it would change nothing), saved into `target`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base or Settings().model_dir, dtype=torch.float32)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    peft_model.save_pretrained(target)
    return target


def peft_greedy(adapter: str | Path | None, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Each prompt's first `new` greedy tokens from transformers' own forward and cache, under the adapter at
    `adapter` through peft (None: the model alone), EOS not treated specially."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Settings().model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            res = model(torch.tensor([ids]), use_cache=True)
            tokens = [int(res.logits[0, -1].argmax())]
            for _ in range(new - 1):
                res = model(torch.tensor([tokens[-1:]]), past_key_values=res.past_key_values, use_cache=True)
                tokens.append(int(res.logits[0, -1].argmax()))
            out.append(tokens)
    return out


def vllm_venv() -> Path:
    """The vLLM venv, for a test that runs in it. Where it is missing the test skips, saying how to make it; with
    REQUIRE_VLLM_TESTS=1 (CI), it fails."""
    if not (VLLM_VENV / ".chatq-setup").exists():
        reason = "no .venv-vllm: `make setup-vllm` makes it, with vLLM's CPU build, for the tests of CHATQ_ENGINE=vllm"
        if os.environ.get("REQUIRE_VLLM_TESTS"):
            pytest.fail(reason)
        pytest.skip(reason)
    return VLLM_VENV


def alive(pid: int | str) -> bool:
    """Whether the process runs: one killed but not yet reaped by whoever inherited it is a zombie, not alive."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# The stacks' greedy answers are the model's own, without the repetition penalty the default model ships
# (tests/worker/test_model.py and tests/api/test_chat.py test that one).
UNPENALISED = {"repetition_penalty": 1.0}


def _env(settings: Settings, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ) | dict(extra or {})
    env.update(
        CHATQ_REDIS_URL=settings.redis_url,
        CHATQ_API_PORT=str(settings.api_port),
        CHATQ_WORKER_CONCURRENCY=str(settings.worker_concurrency),
        CHATQ_SSE_KEEPALIVE=str(settings.sse_keepalive),
        CHATQ_API_KEYS=settings.api_keys.get_secret_value(),
        CHATQ_ADMIN_KEY=settings.admin_key.get_secret_value(),
        CHATQ_MAX_QUEUED=str(settings.max_queued),
        CHATQ_MAX_BODY_BYTES=str(settings.max_body_bytes),
        CHATQ_LOG_FORMAT=settings.log_format,
        CHATQ_BATCH_WINDOW=str(settings.batch_window),
        CHATQ_WORKER_METRICS_PORT=str(settings.worker_metrics_port),
        CHATQ_OVERRIDE_GENERATION_CONFIG=json.dumps(settings.override_generation_config or UNPENALISED),
        PYTHONUNBUFFERED="1",
    )
    env.update(webhook_env(settings), **files_env(settings))
    return env


def files_env(settings: Settings) -> dict[str, str]:
    """The file store's settings as variables: every API and worker must reach the same store."""
    return {
        "CHATQ_FILES_DIR": str(settings.files_path),
        "CHATQ_FILES_S3_BUCKET": settings.files_s3_bucket,
        "CHATQ_FILES_S3_ENDPOINT_URL": settings.files_s3_endpoint_url,
        "CHATQ_FILES_S3_PREFIX": settings.files_s3_prefix,
        "CHATQ_FILES_MAX_BYTES": str(settings.files_max_bytes),
        "CHATQ_FILES_MAX_BATCH_BYTES": str(settings.files_max_batch_bytes),
        "CHATQ_FILES_MIN_EXPIRY": str(settings.files_min_expiry),
        "CHATQ_FILES_SWEEP_INTERVAL": str(settings.files_sweep_interval),
    }


def webhook_env(settings: Settings) -> dict[str, str]:
    """The webhook settings as variables, for every process: the API and the workers build the deliveries too."""
    return {
        "CHATQ_WEBHOOK_URLS": settings.webhook_urls,
        "CHATQ_WEBHOOK_SECRET": settings.webhook_secret.get_secret_value(),
        "CHATQ_WEBHOOK_TIMEOUT": str(settings.webhook_timeout),
        "CHATQ_WEBHOOK_RETRY_FOR": str(settings.webhook_retry_for),
        "CHATQ_WEBHOOK_BACKOFF": str(settings.webhook_backoff),
        "CHATQ_WEBHOOK_BACKOFF_MAX": str(settings.webhook_backoff_max),
    }


@contextlib.contextmanager
def running_stack(settings: Settings, logs: Path, env: Mapping[str, str] | None = None) -> Iterator[str]:
    """A worker and an API (and, with webhook URLs, the webhook worker) on `settings`' Redis, `env` added to their
    environment; the API's base URL once it is healthy."""
    procs = []
    commands = [("worker", worker_command(settings)), ("api", api_command(settings))]
    if settings.webhook_url_list:
        commands.append(("webhooks", webhooks_command(settings)))
    for name, command in commands:
        out = open(logs / f"{name}.log", "wb")  # noqa: SIM115  (closed with the process below)
        procs.append(
            (subprocess.Popen(command, env=_env(settings, env), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT), out)
        )
    base = f"http://{settings.api_host}:{settings.api_port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            dead = [p for p, _ in procs if p.poll() is not None]
            if dead or time.time() > deadline:
                for name in ("worker", "api"):
                    sys.stderr.write((logs / f"{name}.log").read_text()[-3000:])
                raise RuntimeError("the chatq stack did not become healthy")
            time.sleep(0.5)
        yield base
    finally:
        for p, _ in procs:
            p.terminate()
        for p, out in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
            out.close()


@contextlib.contextmanager
def running_api(settings: Settings, logs: Path, env: Mapping[str, str] | None = None) -> Iterator[str]:
    """The API alone, for the routes that need no worker (files); its base URL once it answers."""
    base = f"http://{settings.api_host}:{settings.api_port}"
    with open(logs / "api.log", "wb") as out:
        proc = subprocess.Popen(
            api_command(settings), env=_env(settings, env), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            _wait_until_up(f"{base}/version", proc, logs / "api.log")
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_until_up(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        if proc.poll() is not None or time.time() > deadline:
            sys.stderr.write(log.read_text(errors="replace")[-3000:])
            raise RuntimeError(f"{url} did not answer")
        time.sleep(0.2)


# What boto3 reads in the tests' processes: moto's server takes any credentials.
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class S3Server:
    """moto's standalone S3-compatible server, over HTTP on a port of its own."""

    endpoint: str

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=AWS_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=AWS_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=AWS_ENV["AWS_DEFAULT_REGION"],
        )

    def new_bucket(self) -> str:
        name = f"chatq-{time.time_ns()}"
        self.client().create_bucket(Bucket=name)
        return name

    def names(self, bucket: str) -> set[str]:
        """The keys the bucket holds, unfinished multipart uploads' included."""
        client = self.client()
        objects = client.list_objects_v2(Bucket=bucket).get("Contents", [])
        uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        return {o["Key"] for o in objects} | {f"{u['Key']} (unfinished)" for u in uploads}


@contextlib.contextmanager
def s3_server(logs: Path) -> Iterator[S3Server]:
    port = free_port()
    with open(logs / "moto.log", "wb") as out:
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_until_up(f"http://127.0.0.1:{port}/moto-api/", proc, logs / "moto.log")
            yield S3Server(f"http://127.0.0.1:{port}")
        finally:
            proc.terminate()
            proc.wait(timeout=20)


class Cluster:
    """An API and named worker processes on one Redis, started and stopped as a test needs."""

    def __init__(self, settings: Settings, logs: Path):
        self.settings, self.logs = settings, logs
        self.env = dict(os.environ) | {
            "CHATQ_REDIS_URL": settings.redis_url,
            "CHATQ_API_PORT": str(settings.api_port),
            "CHATQ_WORKER_CONCURRENCY": "8",
            "CHATQ_WORKER_TTL": str(settings.worker_ttl),
            "CHATQ_STOP_GRACE": str(settings.stop_grace),
            "CHATQ_MAX_ATTEMPTS": str(settings.max_attempts),
            "CHATQ_RESULT_TTL": str(settings.result_ttl),
            "CHATQ_SSE_KEEPALIVE": "0.5",
            "PYTHONUNBUFFERED": "1",
        }
        self.r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.models: dict[str, str] = {}  # worker name -> the model it serves
        self._started = 0

    def start(self, name: str, command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        out = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115  (the process holds it)
        proc = subprocess.Popen(command, env=self.env | (env or {}), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start_worker(self, model_name: str = "", venv: Path | None = None, **env: str) -> str:
        """A worker named w1, w2, ...; `model_name` and `env` (CHATQ_ variables) choose another model; `venv`, the
        environment it runs in (the vLLM venv's, say), else this one."""
        self._started += 1
        name = f"w{self._started}"
        settings = self.settings.model_copy(update={"model_name": model_name}) if model_name else self.settings
        command = worker_command(settings)
        if venv is not None:
            command[0] = str(venv / "bin" / Path(command[0]).name)
        command[command.index("-n") + 1] = f"{name}@test"
        extra = {"CHATQ_MODEL_NAME": settings.model_name} | env
        self.start(name, command, extra)
        self.models[name] = settings.model_name
        return name

    def live_workers(self, model: str = "") -> set[str]:
        registry = self.r.zrangebyscore(keys.workers(model or self.settings.model_name), time.time() - 3, "+inf")
        return {entry.split("@")[0] for entry in registry}

    def wait_live(self, *names: str, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while not all(n in self.live_workers(self.models[n]) for n in names):
            dead = [n for n in names if self.procs[n].poll() is not None]
            assert not dead and time.time() < deadline, f"workers {names} did not register: {self.tail(*names)}"
            time.sleep(0.2)

    def holder(self, job_id: str, timeout: float = 120) -> str:
        """The worker running the job, once one claimed it."""
        deadline = time.time() + timeout
        while not (worker := self.r.hget(keys.job(job_id), "worker")):
            assert time.time() < deadline, f"no worker took {job_id}"
            time.sleep(0.05)
        return worker.split("@")[0]

    def signal(self, name: str, sig: int) -> None:
        self.procs[name].send_signal(sig)

    def tail(self, *names: str) -> str:
        return "\n".join((self.logs / f"{n}.log").read_text(errors="replace")[-2000:] for n in names)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait(timeout=30)


@dataclass
class Frame:
    id: int | None
    data: str

    @property
    def json(self) -> dict[str, Any]:
        return json.loads(self.data)


def frames(lines: Iterator[str]) -> Iterator[Frame]:
    """Parses an SSE body line by line; comments (pings) are skipped."""
    event_id, data = None, []
    for line in lines:
        if line == "":
            if data:
                yield Frame(event_id, "\n".join(data))
            event_id, data = None, []
        elif line.startswith("id:"):
            event_id = int(line[3:].strip())
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


def stream(http: httpx.Client, method: str, url: str, **kw: Any) -> list[Frame]:
    with http.stream(method, url, **kw) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        return list(frames(resp.iter_lines()))


def content_of(fs: list[Frame], index: int = 0) -> str:
    out = []
    for f in fs:
        if f.data == "[DONE]":
            continue
        for c in f.json.get("choices", []):
            if c["index"] == index:
                out.append(c["delta"].get("content") or "")
    return "".join(out)


def wait_for(http: httpx.Client, job_id: str, until: Callable[[dict[str, Any]], bool], timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while True:
        job = http.get(f"/v1/chat/completions/{job_id}").json()
        if until(job):
            return job
        assert time.time() < deadline, f"job {job_id} stuck: {job}"
        time.sleep(0.05)


def snapshot(r: redis.Redis, model: str) -> tuple[int, int, int]:
    """What a refused request must leave unchanged: job records, the Celery queue and the waiting set."""
    jobs = sum(1 for k in r.scan_iter(keys.job("*")) if k.count(":") == keys.job("").count(":"))
    queued = sum(r.llen(k) for k in r.scan_iter(keys.celery_queue(model) + "*"))
    return jobs, queued, r.zcard(keys.queued(model))


def cancel_job(settings: Settings, job_id: str, delete: bool = False) -> None:
    """The API's cancel (or delete) of a job, without HTTP."""

    async def cancel() -> None:
        client = async_client(settings.redis_url, decode_responses=True)
        try:
            await JobStore(client, make_celery(settings), settings).cancel(job_id, delete)
        finally:
            await client.aclose()

    asyncio.run(cancel())


def quiesce(r: redis.Redis, settings: Settings, timeout: float = 60) -> None:
    """Cancels the model's queued and running jobs (left by earlier tests: background jobs outlive their test) and
    waits until none is left, so what a test counts next is its own jobs' doing."""
    model = settings.model_name
    for job_id in {*r.zrange(keys.queued(model), 0, -1), *r.smembers(keys.running(model))}:
        with contextlib.suppress(JobNotFound):  # it ended meanwhile, and expired
            cancel_job(settings, job_id)
    deadline = time.time() + timeout
    while r.zcard(keys.queued(model)) or r.scard(keys.running(model)):
        assert time.time() < deadline, "the model's jobs did not end"
        time.sleep(0.05)


def assert_error(resp: httpx.Response, status: int, type_: str, param: str | None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (type_, param, status), error
    assert error["message"]
    return error


def combine(deltas: Iterable[Delta]) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """Deltas of one choice -> (content, reasoning, tool_calls), as the worker builds a final message."""
    message = JoinedDeltas()
    for d in deltas:
        message.add(d)
    return message.result()


def collect(parser: Parser, pieces: Iterable[str]) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """Feed every piece, finish, and combine: the whole parsed message."""
    deltas = [parser.feed(p) for p in pieces]
    deltas.append(parser.finish())
    return combine(deltas)


def built_kernels() -> Any:
    """chatq's CPU kernels, which `make setup` builds: a test that needs them fails where they did not build."""
    from chatq.worker import cpu_kernels

    kernels = cpu_kernels.load()
    assert kernels is not None, "chatq's CPU kernels did not build (they need a C++ compiler)"
    return kernels
