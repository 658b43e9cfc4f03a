"""`chatq`: start the pieces (api, worker, flower, webhooks, or all of them with `up`) and talk to a running API.

The worker's heavy imports happen in its own process, so this module stays light for the API and the client.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pydantic

from chatq.core import keys
from chatq.core.redis_url import masked
from chatq.core.settings import Settings

if TYPE_CHECKING:
    from chatq.embedded_redis import EmbeddedRedis


def _python(*args: str) -> list[str]:
    return [sys.executable, *args]


def _celery(*args: str) -> list[str]:
    # The console script, not `python -m celery`: on SIGHUP a worker restarts itself by running its argv again, and
    # celery/__main__.py run as a file cannot import its own package.
    script = Path(sys.executable).parent / "celery"
    return [str(script), *args] if script.exists() else _python("-m", "celery", *args)


def _quiet(settings: Settings) -> list[str]:
    # Celery's and Flower's start banners are plain text: JSON logs must hold JSON lines only.
    return ["--quiet"] if settings.log_format == "json" else []


def _celery_worker(settings: Settings, app: str, threads: int, queue: str, node: str) -> list[str]:
    return _celery(
        "-A",
        app,
        *_quiet(settings),
        "worker",
        "-P",
        "threads",
        "-c",
        str(threads),
        "-Q",
        queue,
        "-n",
        f"{node}@%h-{os.getpid()}",
        "--without-mingle",
        "--without-gossip",
        "--loglevel",
        "INFO",
    )


def worker_command(settings: Settings) -> list[str]:
    queue = keys.celery_queue(settings.model_name)
    return _celery_worker(settings, "chatq.worker.celery_app", settings.worker_concurrency, queue, settings.model_name)


def webhooks_command(settings: Settings) -> list[str]:
    """The webhook worker: Celery threads delivering background jobs' events, with no model loaded."""
    queue = keys.webhook_queue()
    return _celery_worker(settings, "chatq.worker.webhooks", settings.webhook_concurrency, queue, "webhooks")


def api_command(settings: Settings) -> list[str]:
    return _python(
        "-m",
        "uvicorn",
        "--factory",
        "chatq.api.app:app_from_env",
        "--host",
        settings.api_host,
        "--port",
        str(settings.api_port),
        "--log-level",
        "warning",
    )


def flower_command(settings: Settings) -> list[str]:
    return _celery(
        "-A",
        "chatq.worker.celery_app",
        *_quiet(settings),
        "flower",
        f"--port={settings.flower_port}",
        f"--address={settings.api_host}",
    )


def flower_env(settings: Settings, environ: Mapping[str, str]) -> dict[str, str]:
    """Flower's environment: CHATQ_FLOWER_AUTH becomes its --basic-auth option, passed as FLOWER_BASIC_AUTH, which
    Flower reads as that option: on its command line the password would show in `ps` to every user."""
    env = dict(environ)
    if settings.flower_auth.get_secret_value():
        env["FLOWER_BASIC_AUTH"] = settings.flower_auth.get_secret_value()
    return env


PREPARE = """
import signal, sys
from chatq.core.settings import Settings
from chatq.worker import cpu_kernels
from chatq.worker.model import ensure_model_dir
# Stopped, it unwinds, so the conversion removes its half-written files on the way out.
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
try:
    ensure_model_dir(Settings())
    cpu_kernels.load()  # built now rather than in each worker's first minute
except KeyboardInterrupt:
    sys.exit(130)
"""


def prepare_model() -> None:
    """Converts the default model and builds the CPU kernels once, before anything needs them."""
    proc = subprocess.Popen(_python("-c", PREPARE))
    try:
        if proc.wait() != 0:
            raise subprocess.CalledProcessError(proc.returncode, proc.args)
    except BaseException:
        proc.terminate()
        proc.wait()
        raise


def embedded_redis(settings: Settings) -> EmbeddedRedis:
    """The private Redis of `chatq up`, on 6379 unless that is taken. Its data directory is the port's: a second
    stack on this machine gets a Redis of its own, which must not write into the first one's append-only file."""
    from chatq.embedded_redis import EmbeddedRedis, free_port

    port = free_port(6379)
    data = settings.cache_dir / "redis" / str(port)
    if port == 6379:
        _adopt_shared_data(data)
    return EmbeddedRedis(data, port=port)


# What a Redis keeps in its directory: Redis 6's append-only file, Redis 7's directory of them, its snapshot.
REDIS_FILES = ("appendonly.aof", "appendonlydir", "dump.rdb")


def _adopt_shared_data(data: Path) -> None:
    """Moves the data an earlier chatq kept in the shared `redis/` directory into the default port's, so the jobs
    queued there are not left behind."""
    if data.exists():
        return
    found = [data.parent / name for name in REDIS_FILES if (data.parent / name).exists()]
    if found:
        data.mkdir(parents=True)
        for path in found:
            path.rename(data / path.name)


def up(settings: Settings, with_flower: bool = True) -> int:
    signalled: list[int] = []

    def interrupt(signum: int, _frame: object) -> None:
        signalled.append(signum)
        raise KeyboardInterrupt

    # Installed first, and explicitly: a shell that starts `chatq up` in the background leaves SIGINT ignored, and a
    # signal while Redis starts must still stop it. SIGHUP: the terminal closed.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupt)
    redis_server = None if settings.redis_url else embedded_redis(settings)
    services: dict[str, subprocess.Popen] = {}
    try:
        env = dict(os.environ)
        if redis_server is not None:
            redis_server.start()
            env["CHATQ_REDIS_URL"] = redis_server.url
            settings = settings.model_copy(update={"redis_url": redis_server.url})
            print(f"chatq: embedded Redis at {masked(redis_server.url)}", flush=True)
        prepare_model()
        _start(services, settings, env, with_flower)
        watched = dict(services)
        if redis_server is not None and redis_server.proc is not None:
            watched["redis"] = redis_server.proc  # type: ignore[assignment]
        return _watch(watched)
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:  # Redis would not start: its own words say why
        print(f"chatq: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        try:
            _stop(services, gently=signalled[:1] == [signal.SIGINT])
        except KeyboardInterrupt:  # asked again while waiting (a worker finishing its jobs): stop waiting
            for p in services.values():
                _kill(p)
        finally:
            # Redis goes last, whatever happened above, and is not interrupted while it saves.
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(signum, signal.SIG_IGN)
            if redis_server is not None:
                redis_server.stop()


def _start(services: dict[str, subprocess.Popen], settings: Settings, env: dict[str, str], with_flower: bool) -> None:
    """Starts the worker, the API, the webhook worker (with webhook URLs) and Flower into `services`, one by one, so
    that an interrupt meanwhile stops those already started."""
    services["worker"] = subprocess.Popen(worker_command(settings), env=env)
    services["api"] = subprocess.Popen(api_command(settings), env=env)
    if settings.webhook_url_list:
        services["webhooks"] = subprocess.Popen(webhooks_command(settings), env=env)
    if with_flower:
        services["flower"] = subprocess.Popen(flower_command(settings), env=flower_env(settings, env))
    print(
        f"chatq: starting the API on {_url(settings.api_host, settings.api_port)}"
        + (f" and Flower on {_url(settings.api_host, settings.flower_port)}" if with_flower else ""),
        flush=True,
    )


def _watch(watched: dict[str, subprocess.Popen]) -> int:
    """Waits until a process exits by itself, and says which: the rest are then stopped."""
    while True:
        for name, p in watched.items():
            if p.poll() is not None:
                print(f"chatq: {name} exited with status {p.returncode}; stopping", file=sys.stderr, flush=True)
                return 1
        time.sleep(0.5)


def _stop(services: dict[str, subprocess.Popen], gently: bool) -> None:
    """Stops the services. Gently (a Ctrl-C), the worker is waited for until its running jobs end, however long
    that takes: killed, it would leave them unfinished. Otherwise each gets 15 s after SIGTERM."""
    procs = list(services.values())
    if gently:
        # Ctrl-C reached the whole foreground group, so the services are already stopping; a second signal now
        # makes Flower print a traceback, so they get a moment first.
        deadline = time.time() + 5
        while time.time() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()  # for Celery too a warm shutdown: running jobs finish first
    worker = services.get("worker")
    if gently and worker is not None and worker.poll() is None:
        print("chatq: waiting for running jobs to finish (Ctrl-C again to stop now)", file=sys.stderr, flush=True)
        worker.wait()
    for p in reversed(procs):
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            _kill(p)


def _kill(p: subprocess.Popen) -> None:
    """SIGKILL, then reaped: once `up` returns, none of its services runs (a restart finds their ports free)."""
    if p.poll() is None:
        p.kill()
        p.wait()


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _base_url(settings: Settings) -> str:
    return settings.api_url or _url(settings.api_host, settings.api_port)


def _headers(settings: Settings) -> dict[str, str]:
    """The API key `chat` and `job` send: CHATQ_API_KEY, else the first of the API's own CHATQ_API_KEYS."""
    key = settings.api_key.get_secret_value() or next(iter(settings.api_key_list), "")
    return {"Authorization": f"Bearer {key}"} if key else {}


def chat(settings: Settings, prompt: str, max_tokens: int | None, temperature: float | None) -> int:
    body: dict = {
        "model": settings.model_name,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    url = f"{_base_url(settings)}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=_headers(settings), timeout=None) as r:
        if r.status_code != 200:
            r.read()
            print(r.text, file=sys.stderr)
            return 1
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                print(f"\nerror: {data['error']['message']}", file=sys.stderr)
                return 1
            for choice in data.get("choices", []):
                show_delta(choice["delta"])
    print()
    return 0


def show_delta(delta: dict) -> None:
    """A streamed delta as it reads in a terminal: the answer on stdout, a thought on stderr (so that a pipe gets
    the answer alone), each tool call on a line of its own."""
    if delta.get("reasoning"):
        print(delta["reasoning"], end="", file=sys.stderr, flush=True)
    print(delta.get("content") or "", end="", flush=True)
    for call in delta.get("tool_calls") or []:
        function = call.get("function") or {}
        if function.get("name"):
            print(f"\n[tool call] {function['name']} ", end="")
        print(function.get("arguments") or "", end="", flush=True)


def job(settings: Settings, action: str, job_id: str) -> int:
    base = f"{_base_url(settings)}/v1/chat/completions/{job_id}"
    headers = _headers(settings)
    r = httpx.get(base, headers=headers) if action == "get" else httpx.post(f"{base}/cancel", headers=headers)
    print(json.dumps(r.json(), indent=2))
    return 0 if r.status_code == 200 else 1


_LIMITS = ("rpm", "tpm", "in_flight", "batch_tokens", "weight", "models", "expires_at")


def keys_command(settings: Settings, args: argparse.Namespace) -> int:
    """`chatq keys create|list|show|update|revoke`, through the admin routes with CHATQ_ADMIN_KEY."""
    admin = settings.admin_key.get_secret_value()
    base = f"{_base_url(settings)}/v1/admin/keys"
    headers = {"Authorization": f"Bearer {admin}"} if admin else {}
    # 0 lifts a limit (null in the body).
    body = {k: getattr(args, k) for k in _LIMITS if getattr(args, k, None) is not None}
    body = {k: None if v == 0 and k != "weight" else v for k, v in body.items()}
    if "models" in body:
        body["models"] = [m.strip() for m in body["models"].split(",") if m.strip()]
    if args.action == "create":
        r = httpx.post(base, json=body | {"name": args.name}, headers=headers)
    elif args.action == "list":
        r = httpx.get(base, headers=headers)
    elif args.action == "show":
        r = httpx.get(f"{base}/{args.name}", headers=headers)
    elif args.action == "update":
        r = httpx.post(f"{base}/{args.name}", json=body, headers=headers)
    else:
        r = httpx.delete(f"{base}/{args.name}", headers=headers)
    print(json.dumps(r.json(), indent=2))
    if args.action == "create" and r.status_code == 200:
        print("The key is shown once: keep it now.", file=sys.stderr)
    return 0 if r.status_code == 200 else 1


def _keys_parser(sub: Any) -> None:
    p_keys = sub.add_parser("keys", help="manage API keys at run time (needs CHATQ_ADMIN_KEY)")
    actions = p_keys.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="every key, with its limits")
    for action, doc in (("create", "a new key: printed once"), ("update", "change a key's limits")):
        p = actions.add_parser(action, help=doc)
        p.add_argument("name")
        p.add_argument("--rpm", type=int, help="requests per minute (0: none)")
        p.add_argument("--tpm", type=int, help="tokens per minute, prompt plus max_tokens (0: none)")
        p.add_argument("--in-flight", type=int, help="jobs queued or running at once (0: no cap)")
        p.add_argument("--batch-tokens", type=int, help="input tokens its batches hold enqueued at once (0: none)")
        p.add_argument("--weight", type=float, help="its share of each model's workers against other keys' (1)")
        p.add_argument("--models", help="comma-separated models it may use (default: all)")
        p.add_argument("--expires-at", type=int, help="when it stops working, in Unix seconds")
    for action, doc in (("show", "one key"), ("revoke", "refuse a key from now on")):
        actions.add_parser(action, help=doc).add_argument("name")


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """CHATQ_ variables that name no setting: a misspelt CHATQ_REDIS_URI would otherwise start a private Redis."""
    known = {f"CHATQ_{name.upper()}" for name in Settings.model_fields}
    return sorted(name for name in environ if name.upper().startswith("CHATQ_") and name.upper() not in known)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatq", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "up", help="start Redis (unless CHATQ_REDIS_URL is set), a worker, the API, Flower and any webhook worker"
    ).add_argument("--no-flower", action="store_true")
    sub.add_parser("api", help="start the HTTP API")
    sub.add_parser("worker", help="start a Celery worker holding the model")
    sub.add_parser("flower", help="start Flower")
    sub.add_parser("webhooks", help="start the worker that delivers background jobs' webhooks")
    sub.add_parser(
        "prepare", help="convert the default model into the cache and build the CPU kernels (once per machine)"
    )
    p_chat = sub.add_parser("chat", help="stream an answer from a running API")
    p_chat.add_argument("prompt")
    p_chat.add_argument("--max-tokens", type=int)
    p_chat.add_argument("--temperature", type=float)
    p_job = sub.add_parser("job", help="get or cancel a job")
    p_job.add_argument("action", choices=["get", "cancel"])
    p_job.add_argument("id")
    _keys_parser(sub)
    return parser


def _client(settings: Settings, args: argparse.Namespace) -> int:
    """`chatq chat`, `job` or `keys`, with the exit code a shell expects when the reader or the API goes away."""
    try:
        if args.command == "job":
            return job(settings, args.action, args.id)
        if args.command == "keys":
            return keys_command(settings, args)
        return chat(settings, args.prompt, args.max_tokens, args.temperature)
    except BrokenPipeError:
        # The reader went away (`chatq chat ... | head`); leaving closes the stream, cancelling the job. stdout
        # goes to /dev/null so the final flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except httpx.TransportError as e:
        print(f"chatq: cannot reach the API at {masked(_base_url(settings))} ({e})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # leaving closes the stream, which cancels the job
        print(file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for name in unknown_variables(os.environ):
        print(f"chatq: warning: {name} is not a chatq setting (misspelt?); it is ignored", file=sys.stderr)
    try:
        settings = Settings()
    except pydantic.ValidationError as e:
        for err in e.errors():
            name = "CHATQ_" + "_".join(str(p) for p in err["loc"]).upper()
            print(f"chatq: {name}: {err['msg']}", file=sys.stderr)
        return 2

    if args.command == "up":
        return up(settings, with_flower=not args.no_flower)
    if args.command == "prepare":
        prepare_model()
        return 0
    if args.command in ("chat", "job", "keys"):
        return _client(settings, args)
    if not settings.redis_url:
        parser.error("set CHATQ_REDIS_URL (or use `chatq up`, which starts a Redis of its own)")
    commands = {"api": api_command, "worker": worker_command, "flower": flower_command, "webhooks": webhooks_command}
    command = commands[args.command](settings)
    os.execve(command[0], command, flower_env(settings, os.environ) if args.command == "flower" else os.environ)
    return 0


if __name__ == "__main__":
    sys.exit(main())
