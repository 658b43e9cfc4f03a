"""`chatq up`, the one command that runs everything without Docker: it serves, and a Ctrl-C stops it cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from chatq import cli
from chatq.core.settings import Settings
from chatq.embedded_redis import free_port
from tests.helpers import ROOT, alive


def _wait_for(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"chatq up exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{url} did not answer 200 within {timeout} s:\n{log.read_text()[-3000:]}")


def test_up_serves_a_chat_and_flower_then_stops_on_ctrl_c(tmp_path: Path) -> None:
    # A cache of its own (for the Redis it starts), with the model already converted for the suite.
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(Settings().model_dir.parent)
    api_port, flower_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "CHATQ_REDIS_URL"}
    env |= {
        "CHATQ_CACHE_DIR": str(cache),
        "CHATQ_API_PORT": str(api_port),
        "CHATQ_FLOWER_PORT": str(flower_port),
        "PYTHONUNBUFFERED": "1",
    }
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        # A session of its own, so that the Ctrl-C below reaches its whole group as a terminal's would.
        up = subprocess.Popen(
            [sys.executable, "-m", "chatq.cli", "up"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_for(f"http://127.0.0.1:{api_port}/health", up, log)
        chat = subprocess.run(
            [sys.executable, "-m", "chatq.cli", "chat", "What is the capital of France?", "--max-tokens", "8"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert chat.returncode == 0, chat.stderr
        assert chat.stdout.strip(), "the streamed answer was empty"
        # A reader that leaves early (`chatq chat ... | head -c 1`) ends the command quietly.
        piped = subprocess.Popen(
            [sys.executable, "-m", "chatq.cli", "chat", "Count to twenty.", "--max-tokens", "64"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert piped.stdout is not None and piped.stderr is not None
        assert piped.stdout.read(1)
        piped.stdout.close()
        assert piped.wait(timeout=120) == 141
        assert piped.stderr.read() == b""
        _wait_for(f"http://127.0.0.1:{flower_port}/", up, log, timeout=60)

        os.killpg(up.pid, signal.SIGINT)
        assert up.wait(timeout=40) == 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    output = log.read_text()
    assert "Traceback" not in output, output[-3000:]
    assert "leaked" not in output, output[-3000:]  # extension modules found every object of theirs freed at exit
    # A request leaves no line in the terminal: Celery's per-task INFO lines are off.
    assert not re.search(r"chatq\.generate\[[^\]]*\] (received|succeeded)", output), output[-3000:]
    with pytest.raises(httpx.ConnectError):  # every service stopped with it
        httpx.get(f"http://127.0.0.1:{api_port}/health", timeout=2)


# `chatq up` with its Redis and services replaced by stand-ins: argv[2] is the Redis process's command, argv[3] the
# worker's and argv[4] the API's and Flower's (bash scripts, given the directory to write to as $0).
FAKE_UP = """
import subprocess, sys
from pathlib import Path
import chatq.cli as cli, chatq.embedded_redis as embedded

out, redis_script, worker_script, other_script = Path(sys.argv[1]), *sys.argv[2:]
class Redis:
    url = "redis://127.0.0.1:1/0"
    def __init__(self, *args, **kwargs): pass
    def start(self):
        self.proc = subprocess.Popen(["bash", "-c", redis_script, str(out)], start_new_session=True)
        return self
    def stop(self):
        self.proc.kill()
        (out / "redis-stopped").write_text("yes")
embedded.EmbeddedRedis = Redis
cli.prepare_model = lambda: None
cli.worker_command = lambda settings: ["bash", "-c", worker_script, str(out)]
cli.api_command = cli.flower_command = cli.webhooks_command = lambda settings: ["bash", "-c", other_script, str(out)]
sys.exit(cli.up(cli.Settings(redis_url="")))
"""
# Ignores Ctrl-C and SIGTERM, as a worker finishing its jobs does.
STUBBORN = "trap '' INT TERM; echo $$ >> $0/pids; exec sleep 60"


def fake_up(tmp_path: Path, redis: str, worker: str, other: str, **env_vars: str) -> subprocess.Popen:
    env = (
        {k: v for k, v in os.environ.items() if k != "CHATQ_REDIS_URL"} | {"CHATQ_CACHE_DIR": str(tmp_path)} | env_vars
    )
    return subprocess.Popen(
        [sys.executable, "-c", FAKE_UP, str(tmp_path), redis, worker, other],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_pids(tmp_path: Path, up: subprocess.Popen, n: int) -> list[str]:
    pids = tmp_path / "pids"
    deadline = time.time() + 30
    while not (pids.exists() and len(pids.read_text().split()) == n):
        assert time.time() < deadline and up.poll() is None
        time.sleep(0.1)
    return pids.read_text().split()


def test_a_second_ctrl_c_stops_everything_at_once(tmp_path: Path) -> None:
    up = fake_up(tmp_path, "exec sleep 600", STUBBORN, STUBBORN)
    pids = _wait_for_pids(tmp_path, up, 3)
    up.send_signal(signal.SIGINT)
    time.sleep(6)  # past the moment the services get to stop by themselves: `up` now waits on them
    assert up.poll() is None
    up.send_signal(signal.SIGINT)
    assert up.wait(timeout=10) == 0
    assert (tmp_path / "redis-stopped").read_text() == "yes"
    assert not [pid for pid in pids if alive(pid)]


def test_the_first_ctrl_c_waits_for_running_jobs_however_long(tmp_path: Path) -> None:
    # A worker whose jobs take 22 s to finish once asked to stop: longer than any grace period given to the others.
    worker = (
        "trap 'kill $job; sleep 22; echo done > $0/jobs-finished; exit 0' INT TERM; echo $$ >> $0/pids; "
        "sleep 600 >/dev/null 2>&1 & job=$!; wait"  # not on up's stderr, which the test reads to its end
    )
    up = fake_up(tmp_path, "exec sleep 600", worker, "echo $$ >> $0/pids; exec sleep 600")
    _wait_for_pids(tmp_path, up, 3)
    up.send_signal(signal.SIGINT)
    assert up.wait(timeout=60) == 0
    assert (tmp_path / "jobs-finished").read_text() == "done\n"
    assert up.stderr is not None and "waiting for running jobs to finish" in up.stderr.read()


def test_up_stops_and_says_so_when_its_redis_dies(tmp_path: Path) -> None:
    up = fake_up(tmp_path, "sleep 2; exit 3", "exec sleep 600", "exec sleep 600")
    assert up.wait(timeout=30) == 1
    assert up.stderr is not None and "chatq: redis exited with status 3; stopping" in up.stderr.read()


def test_up_gives_flower_its_login_and_no_other_service(tmp_path: Path) -> None:
    # The API and Flower run the same stand-in: each records the login it was given, Flower's only.
    record = 'echo "login=$FLOWER_BASIC_AUTH" >> $0/logins; echo $$ >> $0/pids; exec sleep 600'
    up = fake_up(tmp_path, "exec sleep 600", "echo $$ >> $0/pids; exec sleep 600", record, CHATQ_FLOWER_AUTH="ops:pw")
    try:
        _wait_for_pids(tmp_path, up, 3)
        assert sorted((tmp_path / "logins").read_text().split()) == ["login=", "login=ops:pw"]
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=30)


@pytest.mark.parametrize("urls", ["http://h/x", ""], ids=["webhook-urls", "none"])
def test_up_starts_the_webhook_worker_only_with_webhook_urls(tmp_path: Path, urls: str) -> None:
    pid = "echo $$ >> $0/pids; exec sleep 600"
    hooks = {"CHATQ_WEBHOOK_URLS": urls, "CHATQ_WEBHOOK_SECRET": "whsec_c2VjcmV0"} if urls else {}
    up = fake_up(tmp_path, "exec sleep 600", pid, pid, **hooks)
    started = 4 if urls else 3  # the worker, the API, Flower, and the webhook worker with URLs
    try:
        _wait_for_pids(tmp_path, up, started)
        time.sleep(1)  # one more, started with the others, would have written its pid by now
        assert len((tmp_path / "pids").read_text().split()) == started
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=30)


def test_chat_shows_a_thought_on_stderr_and_tool_calls_on_their_own_lines(capsys: pytest.CaptureFixture) -> None:
    from chatq.cli import show_delta

    deltas = [
        {"role": "assistant", "content": ""},
        {"reasoning": "Paris, "},
        {"reasoning": "surely."},
        {"content": "Let me check."},
        {"tool_calls": [{"index": 0, "id": "c0", "function": {"name": "get_weather", "arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
        {"tool_calls": [{"index": 1, "id": "c1", "function": {"name": "get_time", "arguments": "{}"}}]},
    ]
    for delta in deltas:
        show_delta(delta)
    out, err = capsys.readouterr()
    assert err == "Paris, surely."
    assert out == 'Let me check.\n[tool call] get_weather {"city": "Paris"}\n[tool call] get_time {}'


def test_a_misspelt_setting_is_named_not_silently_ignored() -> None:
    from chatq.cli import unknown_variables

    environ = {"CHATQ_REDIS_URI": "redis://x", "CHATQ_REDIS_URL": "", "CHATQ_API_URL": "http://x", "HOME": "/"}
    assert unknown_variables(environ) == ["CHATQ_REDIS_URI"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATQ_")} | {
        "CHATQ_API_PROT": "1",
        "CHATQ_API_URL": "http://127.0.0.1:1",
    }
    run = subprocess.run(
        [sys.executable, "-m", "chatq.cli", "job", "get", "x"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert "chatq: warning: CHATQ_API_PROT is not a chatq setting" in run.stderr
    assert "cannot reach the API at http://127.0.0.1:1" in run.stderr and "Traceback" not in run.stderr


def test_a_second_stack_on_the_machine_keeps_its_redis_data_apart(tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path, redis_url="")
    first = cli.embedded_redis(settings).start()
    try:
        second = cli.embedded_redis(settings)
        assert second.port != first.port
        assert second.data_dir != first.data_dir and second.data_dir.parent == first.data_dir.parent
    finally:
        first.stop()


def test_the_data_of_the_shared_redis_directory_moves_to_the_default_ports(tmp_path: Path) -> None:
    shared = tmp_path / "redis"
    shared.mkdir()
    (shared / "appendonly.aof").write_text("queued jobs")
    moved = cli.embedded_redis(Settings(cache_dir=tmp_path, redis_url=""))
    if moved.port != 6379:
        pytest.skip("another server holds port 6379 here, so the default port's directory is not this stack's")
    assert (moved.data_dir / "appendonly.aof").read_text() == "queued jobs"
    assert not (shared / "appendonly.aof").exists()
