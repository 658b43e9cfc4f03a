"""The fair share on the real stack: a worker of two slots busy with one key's jobs takes another key's next,
before the first key's others that waited longer."""

from __future__ import annotations

import time

from tests.api.conftest import KEY_A, KEY_B, Guarded

M = [{"role": "user", "content": "Count to one hundred."}]


def background(g: Guarded, key: str, max_tokens: int) -> str:
    body = {"messages": M, "max_tokens": max_tokens, "ignore_eos": True, "background": True}
    r = g.client(key).post("/v1/chat/completions", json=body)
    assert r.status_code == 202, r.text
    return r.json()["id"]


def started(g: Guarded, job_id: str) -> float:
    deadline = time.monotonic() + 120
    while not (at := g.r.hget(f"chatq:job:{job_id}", "started")):
        assert time.monotonic() < deadline, f"{job_id} never started"
        time.sleep(0.05)
    return float(at)


def test_another_keys_job_goes_before_the_jobs_one_key_queued_earlier(guarded):
    a = [background(guarded, KEY_A, 40) for _ in range(2)]  # both of the worker's slots
    for job_id in a:
        started(guarded, job_id)
    a += [background(guarded, KEY_A, 40) for _ in range(2)]  # they wait
    b = background(guarded, KEY_B, 4)
    order = sorted([*a, b], key=lambda j: started(guarded, j))
    assert order.index(b) == 2  # the first slot to free goes to KEY_B, the key served least
