"""A Redis that wants a password, and one spoken to over TLS (rediss://): every process works through it (the API,
the worker and its Celery broker, the relay's pub/sub, Flower behind its login), and none shows the password in its
output, its errors or /health."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis
from pydantic import SecretStr

from chatq.cli import api_command, flower_command, flower_env
from chatq.core.settings import Settings
from chatq.embedded_redis import free_port, redis_server_binary
from tests.helpers import ROOT, content_of, running_stack, stream

FLOWER_AUTH = "ops:fl0wer-" + secrets.token_hex(4)
WRONG_PASSWORD = "wr0ng-" + secrets.token_hex(8)


def _tls_capable_redis() -> str | None:
    """A redis-server built with TLS: the system one (apt's redis-server), else the venv's if it has it."""
    for binary in dict.fromkeys(filter(None, [shutil.which("redis-server"), redis_server_binary()])):
        # It refuses the bogus log level after the TLS option, unless it refused that first: a build without TLS.
        said = subprocess.run([binary, "--tls-port", "0", "--loglevel", "bogus"], capture_output=True, text=True)
        if "tls-port" not in said.stdout + said.stderr:
            return binary
    return None


def _certificate(tmp: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, which the clients are told to trust as their CA."""
    cert, key = tmp / "redis.crt", tmp / "redis.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return cert, key


@contextmanager
def secured_redis(tmp: Path, password: str, tls: bool) -> Iterator[str]:
    """A redis-server wanting `password` (and TLS only, if asked); its URL as a client would write it."""
    port = free_port()
    args = ["--bind", "127.0.0.1", "--requirepass", password, "--save", "", "--dir", str(tmp)]
    if tls:
        binary = _tls_capable_redis()
        assert binary is not None
        cert, key = _certificate(tmp)
        args += ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
        args += ["--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]
        url = f"rediss://:{password}@127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={cert}"
    else:
        binary, url = redis_server_binary(), f"redis://:{password}@127.0.0.1:{port}/0"
        args += ["--port", str(port)]
    proc = subprocess.Popen([binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 20
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None and time.time() < deadline, "redis-server did not start"
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextmanager
def flower(settings: Settings, log: Path) -> Iterator[str]:
    env = flower_env(settings, os.environ) | {"CHATQ_REDIS_URL": settings.redis_url}
    with open(log, "wb") as out:
        proc = subprocess.Popen(flower_command(settings), env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{settings.flower_port}"
        deadline = time.time() + 60
        while True:
            try:
                httpx.get(f"{base}/healthcheck", timeout=2)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _chat_both_ways(base: str) -> None:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "ignore_eos": True}
    with httpx.Client(base_url=base, timeout=120) as http:
        whole = http.post("/v1/chat/completions", json=body)
        assert whole.status_code == 200, whole.text
        assert whole.json()["usage"]["completion_tokens"] == 8
        frames = stream(http, "POST", "/v1/chat/completions", json=body | {"stream": True})
        assert frames[-1].data == "[DONE]" and content_of(frames)
        ids = [f.id for f in frames if f.id is not None]
        assert ids == list(range(1, len(ids) + 1))
        health = http.get("/health")
        assert health.status_code == 200 and "redis" not in health.text.lower()


def _flower_behind_its_login(base: str) -> None:
    user, password = FLOWER_AUTH.split(":")
    assert httpx.get(f"{base}/api/workers", timeout=10).status_code == 401
    assert httpx.get(f"{base}/api/workers", auth=(user, "wrong"), timeout=10).status_code == 401
    # Flower reaches the broker itself for queue lengths, and the workers through it.
    queues = httpx.get(f"{base}/api/queues/length", auth=(user, password), timeout=30)
    assert queues.status_code == 200, queues.text
    deadline = time.time() + 30
    while not httpx.get(f"{base}/api/workers?refresh=1", auth=(user, password), timeout=30).json():
        assert time.time() < deadline, "Flower never saw the worker"
        time.sleep(1)


def _api_with_a_wrong_password(settings: Settings, password: str, log: Path) -> None:
    """An API given the wrong password: /health says Redis is unreachable, and nothing shows what it was given."""
    url = settings.redis_url.replace(f":{password}@", f":{WRONG_PASSWORD}@")
    wrong = settings.model_copy(update={"redis_url": url, "api_port": free_port()})
    env = dict(os.environ, CHATQ_REDIS_URL=wrong.redis_url, CHATQ_API_PORT=str(wrong.api_port))
    with open(log, "wb") as out:
        proc = subprocess.Popen(api_command(wrong), env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{wrong.api_port}/health", timeout=5)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
                time.sleep(0.3)
        assert health.status_code == 503, health.text
        stream_job = httpx.get(f"http://127.0.0.1:{wrong.api_port}/v1/chat/completions/x?stream=true", timeout=10)
        assert stream_job.status_code == 503
        assert WRONG_PASSWORD not in health.text + stream_job.text
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.mark.parametrize("tls", [False, True], ids=["password", "password+tls"])
def test_every_process_works_through_a_secured_redis_and_shows_no_password(tmp_path: Path, tls: bool) -> None:
    if tls and (_tls_capable_redis() is None or shutil.which("openssl") is None):
        pytest.skip("needs a redis-server built with TLS (apt-get install redis-server) and openssl")
    password = "s3cr3t-" + secrets.token_hex(8)
    with secured_redis(tmp_path, password, tls) as url:
        settings = Settings(
            redis_url=url,
            api_port=free_port(),
            flower_port=free_port(),
            worker_concurrency=4,
            flower_auth=SecretStr(FLOWER_AUTH),
        )
        with running_stack(settings, tmp_path) as base:
            _chat_both_ways(base)
            with flower(settings, tmp_path / "flower.log") as flower_base:
                _flower_behind_its_login(flower_base)
            _api_with_a_wrong_password(settings, password, tmp_path / "wrong-api.log")
    logs = {p.name: p.read_text(errors="replace") for p in tmp_path.glob("*.log")}
    assert set(logs) >= {"worker.log", "api.log", "flower.log", "wrong-api.log"}
    for name, text in logs.items():
        assert password not in text and WRONG_PASSWORD not in text, f"{name} shows the Redis password"
        assert FLOWER_AUTH.split(":")[1] not in text, f"{name} shows Flower's password"
    assert ":**@127.0.0.1" in logs["worker.log"]  # Celery's banner names the broker, its password masked
