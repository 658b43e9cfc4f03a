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

from shared.embedded_redis import free_port
from shared.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


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
            [sys.executable, "-m", "shared.cli", "up"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_for(f"http://127.0.0.1:{api_port}/health", up, log)
        chat = subprocess.run(
            [sys.executable, "-m", "shared.cli", "chat", "What is the capital of France?", "--max-tokens", "8"],
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
            [sys.executable, "-m", "shared.cli", "chat", "Count to twenty.", "--max-tokens", "64"],
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


# `chatq up` with its services replaced by processes that ignore Ctrl-C and SIGTERM, as a worker finishing its jobs
# does, and its Redis by one that records being stopped.
STUBBORN_UP = """
import subprocess, sys
from pathlib import Path
import shared.cli as cli, shared.embedded_redis as embedded

out = Path(sys.argv[1])
class Redis:
    url = "redis://127.0.0.1:1/0"
    def __init__(self, *args, **kwargs): pass
    def start(self):
        self.proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
        return self
    def stop(self):
        self.proc.kill()
        (out / "redis-stopped").write_text("yes")
embedded.EmbeddedRedis = Redis
cli.prepare_model = lambda settings: None
def stubborn(settings):
    return ["bash", "-c", f"trap '' INT TERM; echo $$ >> {out}/pids; exec sleep 60"]
cli.worker_command = cli.api_command = cli.flower_command = stubborn
sys.exit(cli.up(cli.Settings(redis_url="")))
"""


def test_a_second_ctrl_c_stops_everything_at_once(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CHATQ_REDIS_URL"} | {"CHATQ_CACHE_DIR": str(tmp_path)}
    up = subprocess.Popen([sys.executable, "-c", STUBBORN_UP, str(tmp_path)], cwd=ROOT, env=env)
    pids = tmp_path / "pids"
    deadline = time.time() + 30
    while not (pids.exists() and len(pids.read_text().split()) == 3):
        assert time.time() < deadline and up.poll() is None
        time.sleep(0.1)
    up.send_signal(signal.SIGINT)
    time.sleep(6)  # past the moment the services get to stop by themselves: `up` now waits on them
    assert up.poll() is None
    up.send_signal(signal.SIGINT)
    assert up.wait(timeout=10) == 0
    assert (tmp_path / "redis-stopped").read_text() == "yes"
    assert not [pid for pid in pids.read_text().split() if _running(pid)]


def _running(pid: str) -> bool:
    try:  # a process killed but not yet reaped by whoever inherited it is a zombie: not running
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
