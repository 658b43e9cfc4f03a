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
