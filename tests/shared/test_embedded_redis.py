"""The embedded Redis that `chatq up` starts outlives a terminal's Ctrl-C until chatq itself stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import redis

# Starts an EmbeddedRedis, prints its port and pid, and waits: the Ctrl-C below interrupts it before it can stop Redis.
# Python only turns SIGINT into KeyboardInterrupt if its parent did not ignore the signal, as a shell does for the
# commands it starts in the background (a CI job's test run may be one): the child takes Ctrl-C as a terminal would.
CHILD = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path
    from shared.embedded_redis import EmbeddedRedis
    signal.signal(signal.SIGINT, signal.default_int_handler)
    server = EmbeddedRedis(Path(sys.argv[1]), persist=False).start()
    print(server.port, server.proc.pid, flush=True)
    time.sleep(60)
    """
)


def test_ctrl_c_to_the_foreground_group_leaves_redis_running(tmp_path):
    # The child leads a process group of its own, as a shell's foreground job does; a terminal's Ctrl-C is a SIGINT
    # to every process of that group.
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    port, pid = map(int, child.stdout.readline().split())
    try:
        os.killpg(child.pid, signal.SIGINT)
        child.wait(timeout=10)
        assert redis.Redis(port=port).ping()
    finally:
        os.kill(pid, signal.SIGTERM)
