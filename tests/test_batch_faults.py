"""A batch runs on through its API's and its worker's death (each SIGKILLed mid-batch and started again) and a Redis
restart: every line is answered exactly once in its output file, as the same request sent directly answers."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

from tests.test_faults import Stack, services, wait_answers

LINES = 40


def body(i: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": f"Count from {i} to {i + 5}."}],
        "max_tokens": 24,
        "temperature": 0,
    }


def sdk(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base}/v1", api_key="unused", max_retries=5, timeout=120)


def completed(client: openai.OpenAI, batch_id: str, at_least: int, timeout: float = 300) -> Any:
    deadline = time.time() + timeout
    while True:
        try:
            batch = client.batches.retrieve(batch_id)
            if batch.request_counts is not None and batch.request_counts.completed >= at_least:
                return batch
            assert batch.status in ("validating", "in_progress", "finalizing"), batch
        except openai.APIConnectionError:  # the API or Redis is restarting
            pass
        assert time.time() < deadline, f"fewer than {at_least} lines answered"
        time.sleep(0.2)


def kill(stack: Stack, name: str) -> None:
    proc = stack.procs[name].popen
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=20)


def test_a_batch_answers_every_line_once_through_api_and_worker_deaths_and_a_redis_restart(tmp_path: Path) -> None:
    with services(tmp_path) as stack:
        client = sdk(stack)
        lines = [
            json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body(i)})
            for i in range(LINES)
        ]
        uploaded = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        completed(client, batch.id, 3)
        kill(stack, "api")
        kill(stack, "worker")
        stack.start("api")
        stack.start("worker")
        wait_answers(f"{stack.base}/health", list(stack.procs.values()))

        completed(client, batch.id, 15)
        stack.restart_redis()

        done = completed(client, batch.id, LINES)
        deadline = time.time() + 120
        while (done := client.batches.retrieve(batch.id)).status != "completed":
            assert time.time() < deadline, done
            time.sleep(0.2)
        assert (done.request_counts.total, done.request_counts.failed) == (LINES, 0)
        assert done.error_file_id is None and done.output_file_id is not None
        outputs = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(o["custom_id"] for o in outputs) == sorted(f"c{i}" for i in range(LINES))

        with ThreadPoolExecutor(8) as pool:
            direct = list(
                pool.map(
                    lambda i: client.chat.completions.create(model=stack.settings.model_name, **body(i)), range(LINES)
                )
            )
        answers = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in outputs}
        assert answers == {f"c{i}": d.choices[0].message.content for i, d in enumerate(direct)}
