"""The embedded Redis that `chatq up` starts outlives a terminal's Ctrl-C until chatq itself stops it, and does not
outlive chatq."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import redis

from tests.helpers import ROOT, alive

# Starts an EmbeddedRedis, prints its port and pid, and waits, through a Ctrl-C too, as `chatq up` stops its other
# services before Redis. Python only turns SIGINT into KeyboardInterrupt if its parent did not ignore the signal, as
# a shell does for the commands it starts in the background (a CI job's test run may be one): the child takes Ctrl-C
# as a terminal would.
CHILD = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path
    from chatq.embedded_redis import EmbeddedRedis
    signal.signal(signal.SIGINT, signal.default_int_handler)
    server = EmbeddedRedis(Path(sys.argv[1]), persist=False).start()
    try:
        # Inside the try: the Ctrl-C may land before the print statement itself has returned.
        print(server.port, server.proc.pid, flush=True)
        time.sleep(60)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        time.sleep(60)
    """
)


def test_redis_takes_no_ctrl_c_of_its_own_and_ends_with_whoever_started_it(tmp_path):
    # The child leads a process group of its own, as a shell's foreground job does; a terminal's Ctrl-C is a SIGINT
    # to every process of that group.
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=ROOT,
    )
    assert child.stdout is not None
    port, pid = map(int, child.stdout.readline().split())
    try:
        os.killpg(child.pid, signal.SIGINT)
        assert child.stdout.readline().strip() == "interrupted"
        assert redis.Redis(port=port).ping()  # still serving while its starter stops the rest
        # Its starter killed outright, before it could stop Redis: Redis does not live on holding its data dir.
        child.kill()
        child.wait(timeout=10)
        deadline = time.time() + 10
        while alive(pid):
            assert time.time() < deadline, "redis-server outlived the process that started it"
            time.sleep(0.05)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
