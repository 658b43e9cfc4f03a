"""Property-based fuzzing of every route of the API's published OpenAPI schema, with schemathesis.

Two passes: each operation alone with generated inputs, then a stateful run that follows OpenAPI links from a
created job's `id` to its GET, cancel and DELETE, so those routes see real job ids. A case counts as a 5xx, a crash
(the connection failed: the API died or dropped it) or a hang (no complete answer within the per-request timeout).

Run from the repository root against a fresh stack (Redis, a worker, the API), or an API already running:

    python bench/fuzz.py --cases 2000
    python bench/fuzz.py --url http://127.0.0.1:8000 --cases 500

tests/api/test_fuzz.py runs a short pass of the same code against the test session's stack.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core.transport import Response

ROOT = Path(__file__).resolve().parent.parent
# Generation stays cheap: every generated request asks for a handful of tokens at most, and few choices.
MAX_TOKENS, MAX_N = 4, 2
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
JOB_ROUTE = "/v1/chat/completions/{job_id}"


@dataclass
class Tally:
    """What the fuzzing met: cases per operation, and the cases that failed, described."""

    cases: Counter[str] = field(default_factory=Counter)
    answered: Counter[tuple[str, int]] = field(default_factory=Counter)  # (operation, status) -> cases
    server_errors: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    slowest: list[tuple[float, str]] = field(default_factory=list)  # the ten slowest answers, seconds first

    def timed(self, seconds: float, what: str) -> None:
        self.slowest = sorted([*self.slowest, (seconds, what)])[-10:]

    @property
    def failures(self) -> list[str]:
        return self.server_errors + self.crashes + self.hangs


def with_links(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with OpenAPI links from a created chat completion's `id` to the routes that take a job id.

    FastAPI documents only the 200 of the create route; the 202 of a background job gets the same links.
    """
    schema = copy.deepcopy(schema)
    paths = schema["paths"]
    targets = {
        "GetJob": paths[JOB_ROUTE]["get"]["operationId"],
        "DeleteJob": paths[JOB_ROUTE]["delete"]["operationId"],
        "CancelJob": paths[JOB_ROUTE + "/cancel"]["post"]["operationId"],
    }
    links = {
        name: {"operationId": op, "parameters": {"path.job_id": "$response.body#/id"}} for name, op in targets.items()
    }
    responses = paths["/v1/chat/completions"]["post"]["responses"]
    responses["200"]["links"] = links
    responses["202"] = {"description": "A background job, queued", "links": links}
    return schema


def cheap(body: Any) -> Any:
    """A generated body with its generation kept short: token counts and `n` capped, a missing limit set."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for name in TOKEN_FIELDS:
        if isinstance(body.get(name), int) and body[name] > MAX_TOKENS:
            body[name] = MAX_TOKENS
    if not any(isinstance(body.get(name), int) for name in TOKEN_FIELDS):
        body["max_tokens"] = MAX_TOKENS
    if isinstance(body.get("n"), int) and body["n"] > MAX_N:
        body["n"] = MAX_N
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > MAX_TOKENS:
        body["min_tokens"] = MAX_TOKENS
    return body


class Caller:
    """Sends a case with a deadline on the whole answer (an SSE stream's keep-alives reset a read timeout), and
    tallies what came back."""

    def __init__(self, base_url: str, tally: Tally, timeout: float):
        self.base_url = base_url
        self.tally = tally
        self.timeout = timeout
        self.session = requests.Session()

    def call(self, case: schemathesis.Case) -> Response | None:
        if isinstance(case.body, dict):
            case.body = cheap(case.body)
        kwargs = case.as_transport_kwargs(base_url=self.base_url)
        label = f"{case.method} {case.formatted_path}"
        self.tally.cases[f"{case.method} {case.path}"] += 1
        start = time.monotonic()
        try:
            with self.session.request(**kwargs, stream=True, timeout=(5, self.timeout)) as resp:
                body = bytearray()
                for chunk in resp.iter_content(1 << 14):
                    body += chunk
                    if time.monotonic() - start > self.timeout:
                        self.tally.hangs.append(f"{label}: no end after {self.timeout:.0f} s: {_show(kwargs)}")
                        return None
                resp._content = bytes(body)
        except requests.Timeout:
            self.tally.hangs.append(f"{label}: no answer within {self.timeout:.0f} s: {_show(kwargs)}")
            return None
        except requests.RequestException as e:
            self.tally.crashes.append(f"{label}: {type(e).__name__}: {e}: {_show(kwargs)}")
            return None
        self.tally.answered[f"{case.method} {case.path}", resp.status_code] += 1
        self.tally.timed(time.monotonic() - start, f"{label} -> {resp.status_code}: {_show(kwargs)}")
        if resp.status_code >= 500:
            text = resp.content[:300].decode(errors="replace")
            self.tally.server_errors.append(f"{label} -> {resp.status_code} {text}: {_show(kwargs)}")
        return Response.from_requests(resp, verify=True)


def _show(kwargs: dict[str, Any]) -> str:
    sent = {k: kwargs[k] for k in ("params", "headers", "json", "data") if kwargs.get(k) not in (None, {}, b"")}
    return repr(sent)[:500]


def _settings(max_examples: int, steps: int = 10, derandomize: bool = False) -> hypothesis.settings:
    return hypothesis.settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=derandomize,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is tallied, not raised
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


# Only the links with_links adds: links schemathesis infers (a model card's `id` to GET /v1/models/{model}) would
# take the stateful sequences' steps from the job routes.
CONFIG = schemathesis.config.SchemathesisConfig.from_dict({"phases": {"stateful": {"inference": {"algorithms": []}}}})


def load_schema(base_url: str) -> schemathesis.BaseSchema:
    raw = httpx.get(f"{base_url}/openapi.json", timeout=10).json()
    return schemathesis.openapi.from_dict(with_links(raw), config=CONFIG)


def fuzz_operations(schema: schemathesis.BaseSchema, caller: Caller, per_operation: int, fixed: bool) -> None:
    """Each operation alone, `per_operation` generated cases each: inputs that fit the schema and inputs that
    break it (wrong types, missing fields, bad headers and query values)."""
    for result in schema.get_all_operations():
        operation = result.ok()
        cases = st.one_of(operation.as_strategy(), operation.as_strategy(GenerationMode.NEGATIVE))

        @given(case=cases)
        @_settings(per_operation, derandomize=fixed)
        def one(case: schemathesis.Case) -> None:
            caller.call(case)

        one()


def fuzz_stateful(schema: schemathesis.BaseSchema, caller: Caller, scenarios: int, steps: int, fixed: bool) -> None:
    """Sequences of calls in which created jobs' ids flow to the job routes along the links."""

    class Machine(schema.as_state_machine()):  # type: ignore[misc]
        def call(self, case: schemathesis.Case, **kwargs: Any) -> Response:
            response = caller.call(case)
            if response is None:  # tallied; the sequence cannot go on from a failed call
                raise hypothesis.errors.UnsatisfiedAssumption()
            return response

        def validate_response(self, response: Response, case: schemathesis.Case, **kwargs: Any) -> None:
            return None  # the caller tallied it: only 5xx, crashes and hangs count here

    # A live server answers a replayed sequence differently (a job has ended since), which changes the rules it can
    # take next: hypothesis then ends the stateful run, every call so far tallied.
    with contextlib.suppress(hypothesis.errors.FlakyStrategyDefinition):
        Machine.run(settings=_settings(scenarios, steps, derandomize=fixed))


def fuzz(
    base_url: str, per_operation: int, scenarios: int, steps: int = 6, timeout: float = 60, fixed: bool = False
) -> Tally:
    """Fuzzes the API at `base_url`; `fixed`, the cases are the same every run (a test's), else new ones."""
    tally = Tally()
    schema = load_schema(base_url)
    caller = Caller(base_url, tally, timeout)
    fuzz_operations(schema, caller, per_operation, fixed)
    fuzz_stateful(schema, caller, scenarios, steps, fixed)
    return tally


def table(tally: Tally, seconds: float) -> str:
    rows = [f"{'operation':<46} {'cases':>6}  statuses"]
    for op, n in sorted(tally.cases.items()):
        statuses = sorted((status, k) for (o, status), k in tally.answered.items() if o == op)
        rows.append(f"{op:<46} {n:>6}  " + " ".join(f"{status}:{k}" for status, k in statuses))
    rows.append("")
    rows.append(f"{'cases run':<12} {'5xx':>6} {'crashes':>8} {'hangs':>6} {'seconds':>8}")
    counts = (len(tally.server_errors), len(tally.crashes), len(tally.hangs))
    rows.append(f"{sum(tally.cases.values()):<12} {counts[0]:>6} {counts[1]:>8} {counts[2]:>6} {seconds:>8.1f}")
    rows += [f"  {f}" for f in tally.failures[:50]]
    rows.append("slowest answers:")
    rows += [f"  {took:6.2f} s  {what[:300]}" for took, what in reversed(tally.slowest)]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an API already running (default: start Redis, a worker and the API)")
    parser.add_argument("--cases", type=int, default=1000, help="roughly how many requests to send (default 1000)")
    parser.add_argument("--steps", type=int, default=6, help="calls per stateful scenario (default 6)")
    parser.add_argument("--timeout", type=float, default=60, help="seconds one request may take (default 60)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from bench.common import Services

    start = time.monotonic()
    with Services(worker_concurrency=32) if args.url is None else _Given(args.url) as services:
        operations = sum(1 for _ in load_schema(services.base_url).get_all_operations())
        per_operation = max(1, args.cases // 2 // operations)
        scenarios = max(1, args.cases // 2 // args.steps)
        tally = fuzz(services.base_url, per_operation, scenarios, args.steps, args.timeout)
    print(table(tally, time.monotonic() - start))
    return 1 if tally.failures else 0


@dataclass
class _Given:
    """An API someone else runs, in the place of bench.common.Services."""

    base_url: str

    def __enter__(self) -> _Given:
        return self

    def __exit__(self, *_: object) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
