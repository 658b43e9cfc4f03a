"""Every route of the published OpenAPI schema, fuzzed with schemathesis against the real stack: whatever a client
sends, the API answers it, with no 5xx, no dropped connection and no request left hanging.

A short pass of bench/fuzz.py (which runs long ones): each operation alone, then stateful sequences in which a
created job's id flows along OpenAPI links to its GET, cancel and DELETE.
"""

from __future__ import annotations

import httpx

from bench.fuzz import JOB_ROUTE, fuzz, load_schema

PER_OPERATION, SCENARIOS, STEPS = 12, 20, 5


def test_the_schema_links_a_created_job_to_every_route_that_takes_its_id(stack: str) -> None:
    raw = load_schema(stack).raw_schema
    links = raw["paths"]["/v1/chat/completions"]["post"]["responses"]["202"]["links"]
    assert {link["operationId"] for link in links.values()} == {
        raw["paths"][JOB_ROUTE]["get"]["operationId"],
        raw["paths"][JOB_ROUTE]["delete"]["operationId"],
        raw["paths"][JOB_ROUTE + "/cancel"]["post"]["operationId"],
    }


def test_no_generated_request_gets_a_5xx_a_crash_or_a_hang(stack: str) -> None:
    tally = fuzz(stack, PER_OPERATION, SCENARIOS, STEPS, timeout=60, fixed=True)
    operations = {
        f"{method.upper()} {path}" for path, item in load_schema(stack).raw_schema["paths"].items() for method in item
    }
    assert set(tally.cases) == operations  # every route was reached
    assert sum(tally.cases.values()) >= 80
    # The links gave the job routes real ids: some calls found their job (which calls, the generated sequences say).
    job_routes = {f"GET {JOB_ROUTE}", f"DELETE {JOB_ROUTE}", f"POST {JOB_ROUTE}/cancel"}
    found = {o for o, status in tally.answered if o in job_routes and status == 200}
    assert not tally.failures, "\n".join(tally.failures)  # first: a hang or crash also cuts its sequence short
    assert found, sorted(tally.answered.items())
    assert httpx.get(f"{stack}/health", timeout=10).status_code == 200  # the API (and the worker) lived through it
