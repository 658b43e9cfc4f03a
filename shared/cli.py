"""`chatq`: start the pieces (api, worker, flower, or all of them with `up`) and talk to a running API.

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

import httpx

from shared import keys
from shared.settings import Settings


def _python(*args: str) -> list[str]:
    return [sys.executable, *args]


def worker_command(settings: Settings) -> list[str]:
    return _python(
        "-m",
        "celery",
        "-A",
        "worker.celery_app",
        "worker",
        "-P",
        "threads",
        "-c",
        str(settings.worker_concurrency),
        "-Q",
        keys.celery_queue(settings.model_name),
        "-n",
        f"{settings.model_name}@%h-{os.getpid()}",
        "--without-mingle",
        "--without-gossip",
        "--loglevel",
        "INFO",
    )


def api_command(settings: Settings) -> list[str]:
    return _python(
        "-m",
        "uvicorn",
        "--factory",
        "api.app:app_from_env",
        "--host",
        settings.api_host,
        "--port",
        str(settings.api_port),
        "--log-level",
        "warning",
    )


def flower_command(settings: Settings) -> list[str]:
    return _python(
        "-m",
        "celery",
        "-A",
        "worker.celery_app",
        "flower",
        f"--port={settings.flower_port}",
        f"--address={settings.api_host}",
    )


def prepare_model(settings: Settings) -> None:
    """Converts the default model once, before anything needs its files."""
    subprocess.run(
        _python(
            "-c",
            "from shared.settings import Settings; from worker.model import ensure_model_dir; "
            "ensure_model_dir(Settings())",
        ),
        check=True,
    )


def up(settings: Settings, with_flower: bool = True) -> int:
    from shared.embedded_redis import EmbeddedRedis

    redis_server = None
    env = dict(os.environ)
    if not settings.redis_url:
        redis_server = EmbeddedRedis(settings.cache_dir / "redis", port=6379).start()
        env["CHATQ_REDIS_URL"] = redis_server.url
        settings = settings.model_copy(update={"redis_url": redis_server.url})
        print(f"chatq: embedded Redis at {redis_server.url}", flush=True)
    procs: list[subprocess.Popen] = []

    signalled: list[int] = []

    def interrupt(signum: int, _frame: object) -> None:
        signalled.append(signum)
        raise KeyboardInterrupt

    # Installed explicitly: a shell that starts `chatq up` in the background leaves SIGINT ignored.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    try:
        prepare_model(settings)
        procs.append(subprocess.Popen(worker_command(settings), env=env))
        procs.append(subprocess.Popen(api_command(settings), env=env))
        if with_flower:
            procs.append(subprocess.Popen(flower_command(settings), env=env))
        print(
            f"chatq: API on http://{settings.api_host}:{settings.api_port}"
            + (f", Flower on http://{settings.api_host}:{settings.flower_port}" if with_flower else ""),
            flush=True,
        )
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        try:
            _stop(procs, gently=signalled[:1] == [signal.SIGINT])
        except KeyboardInterrupt:  # asked again while waiting (a worker finishing its jobs): stop waiting
            for p in procs:
                if p.poll() is None:
                    p.kill()
        finally:
            # Redis goes last, whatever happened above, and is not interrupted while it saves.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if redis_server:
                redis_server.stop()


def _stop(procs: list[subprocess.Popen], gently: bool) -> None:
    if gently:
        # A terminal's Ctrl-C reached the whole foreground group, so the services are already stopping; a second
        # signal in the middle of that makes Flower print a traceback. They get a moment to finish first.
        deadline = time.time() + 5
        while time.time() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    for p in reversed(procs):
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()


def _base_url(settings: Settings) -> str:
    return os.environ.get("CHATQ_API_URL", f"http://{settings.api_host}:{settings.api_port}")


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
    with httpx.stream("POST", f"{_base_url(settings)}/v1/chat/completions", json=body, timeout=None) as r:
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
                print(choice["delta"].get("content") or "", end="", flush=True)
    print()
    return 0


def job(settings: Settings, action: str, job_id: str) -> int:
    base = f"{_base_url(settings)}/v1/chat/completions/{job_id}"
    r = httpx.get(base) if action == "get" else httpx.post(f"{base}/cancel")
    print(json.dumps(r.json(), indent=2))
    return 0 if r.status_code == 200 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chatq", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start Redis (unless CHATQ_REDIS_URL is set), a worker, the API and Flower").add_argument(
        "--no-flower", action="store_true"
    )
    sub.add_parser("api", help="start the HTTP API")
    sub.add_parser("worker", help="start a Celery worker holding the model")
    sub.add_parser("flower", help="start Flower")
    sub.add_parser("prepare", help="convert the default model into the cache (once per machine)")
    p_chat = sub.add_parser("chat", help="stream an answer from a running API")
    p_chat.add_argument("prompt")
    p_chat.add_argument("--max-tokens", type=int)
    p_chat.add_argument("--temperature", type=float)
    p_job = sub.add_parser("job", help="get or cancel a job")
    p_job.add_argument("action", choices=["get", "cancel"])
    p_job.add_argument("id")
    args = parser.parse_args(argv)
    settings = Settings()

    if args.command == "up":
        return up(settings, with_flower=not args.no_flower)
    if args.command == "prepare":
        prepare_model(settings)
        return 0
    if args.command == "chat":
        try:
            return chat(settings, args.prompt, args.max_tokens, args.temperature)
        except BrokenPipeError:
            # The reader went away (`chatq chat ... | head`): leaving closes the stream, which cancels the job.
            # stdout is pointed at /dev/null so the interpreter's final flush does not fail a second time.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
    if args.command == "job":
        return job(settings, args.action, args.id)
    if not settings.redis_url:
        parser.error("set CHATQ_REDIS_URL (or use `chatq up`, which starts a Redis of its own)")
    command = {"api": api_command, "worker": worker_command, "flower": flower_command}[args.command](settings)
    os.execv(command[0], command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
