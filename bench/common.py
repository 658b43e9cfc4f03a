"""What the benchmarks share: the chatq services started as tests/conftest.py starts them, a streaming client, stats.

Imported as `bench.common`; each script puts the repository root on sys.path before importing it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from chatq.cli import api_command, worker_command
from chatq.core.settings import Settings
from chatq.embedded_redis import EmbeddedRedis, free_port

ROOT = Path(__file__).resolve().parent.parent
# Where bench/zero_worker.py keeps its engine-loop counters.
STATS_KEY = "bench:zero_worker:stats"
# A task bench/zero_worker.py registers that does nothing: the cost of Celery alone per task.
NOOP_TASK = "chatq.bench.noop"


# --- processes ------------------------------------------------------------------------------------------


class Proc:
    """One subprocess run from the repository root, its output in a log file."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_dir: Path):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log: IO[bytes] = open(self.log_path, "wb")  # noqa: SIM115  (closed in stop)
        self.popen = subprocess.Popen(command, env=env, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.popen.terminate()
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def wait_healthy(url: str, procs: Sequence[Proc], timeout: float = 300) -> None:
    """Polls `url` until it answers 200; fails early, with the logs, if a process died."""
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        dead = [p for p in procs if not p.alive()]
        if dead or time.time() > deadline:
            for p in procs:
                sys.stderr.write(f"--- {p.name} log ---\n{p.tail()}\n")
            raise RuntimeError(f"{url} did not become healthy ({'died: ' + dead[0].name if dead else 'timeout'})")
        time.sleep(0.5)


class Services:
    """Embedded Redis, Celery workers (one unless `workers` says) and one API as subprocesses configured by CHATQ_*
    variables.

    A context manager: everything started is stopped on exit. `worker_app` swaps the Celery app module of the worker
    (the zero-cost test double of bench/zero_worker.py); the command line is otherwise `chatq.cli.worker_command`'s.
    """

    def __init__(
        self,
        worker_concurrency: int,
        worker_app: str = "chatq.worker.celery_app",
        device: str = "auto",
        keep_logs: bool = False,
        extra_env: dict[str, str] | None = None,
        workers: int = 1,
    ):
        self.worker_concurrency = worker_concurrency
        self.workers = workers
        self.env: dict[str, str] = {}
        self.extra_env = extra_env or {}
        self.keep_logs = keep_logs
        self.worker_app = worker_app
        self.device = device
        self.tmp = Path(tempfile.mkdtemp(prefix="chatq-bench-"))
        self.redis: EmbeddedRedis | None = None
        self.procs: list[Proc] = []
        self.settings = Settings()

    @property
    def base_url(self) -> str:
        return f"http://{self.settings.api_host}:{self.settings.api_port}"

    @property
    def pids(self) -> dict[str, int]:
        out = {p.name: p.pid for p in self.procs}
        if self.redis is not None and self.redis.proc is not None:
            out["redis"] = self.redis.proc.pid
        return out

    def __enter__(self) -> Services:
        try:
            self.redis = EmbeddedRedis(self.tmp / "redis", persist=False).start()
            self.settings = Settings(
                redis_url=self.redis.url, api_port=free_port(), worker_concurrency=self.worker_concurrency
            )
            env = dict(os.environ)
            env.update(
                CHATQ_REDIS_URL=self.settings.redis_url,
                CHATQ_API_PORT=str(self.settings.api_port),
                CHATQ_WORKER_CONCURRENCY=str(self.worker_concurrency),
                CHATQ_DEVICE=self.device,
                PYTHONUNBUFFERED="1",
            )
            env.update(self.extra_env)
            self.env = env
            for _ in range(self.workers):
                self.add_worker()
            self.procs.append(Proc("api", api_command(self.settings), env, self.tmp))
            wait_healthy(f"{self.base_url}/health", self.procs)
        except BaseException:
            self.__exit__()
            raise
        return self

    def add_worker(self) -> Proc:
        """Starts one more worker, named worker, worker2, ... (its Celery node name too)."""
        name = "worker" + (str(n) if (n := 1 + sum(p.name.startswith("worker") for p in self.procs)) > 1 else "")
        worker = [self.worker_app if a == "chatq.worker.celery_app" else a for a in worker_command(self.settings)]
        worker[worker.index("-n") + 1] = f"{name}@%h"
        proc = Proc(name, worker, self.env, self.tmp)
        self.procs.append(proc)
        return proc

    def __exit__(self, *_: object) -> None:
        for p in reversed(self.procs):
            p.stop()
        if self.redis is not None:
            self.redis.stop()
        if self.keep_logs:
            print(f"service logs kept in {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


# --- client ---------------------------------------------------------------------------------------------


def http_client(timeout: float = 900) -> httpx.AsyncClient:
    # No pool limit: httpx's default of 100 connections would queue streams beyond the 100th inside the client.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=30),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


@dataclass
class StreamResult:
    """One streamed request as the client saw it; times are time.time() seconds."""

    start: float
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each chunk with non-empty content
    completion_tokens: int = 0  # from the usage chunk, else the number of content chunks
    job_id: str | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> StreamResult:
    """POSTs a streamed chat completion and reads its SSE frames to the end ([DONE] or the closed response)."""
    res = StreamResult(start=time.time())
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                res.error = f"HTTP {r.status_code}: {r.text[:200]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.time()
                    obj = json.loads(data)
                    if "error" in obj:
                        res.error = str(obj["error"])[:200]
                        continue
                    res.job_id = res.job_id or obj.get("id")
                    if any((c.get("delta") or {}).get("content") for c in obj.get("choices") or []):
                        res.token_times.append(now)
                    if obj.get("usage"):
                        res.completion_tokens = int(obj["usage"]["completion_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = repr(e)
    res.end = time.time()
    res.completion_tokens = res.completion_tokens or len(res.token_times)
    return res


# --- statistics and output ------------------------------------------------------------------------------


def pct(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100), linearly interpolated; nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1000:.1f}"  # nan -> "-"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain text table: the first column left-aligned, the others right-aligned."""
    cells = [list(headers)] + [[str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths, strict=True)))

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths), *(line(r) for r in cells[1:])])


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nwrote {path}")
