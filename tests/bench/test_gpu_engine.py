"""bench/gpu_engine.py, the GPU check, in its quick mode on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import ROOT

# chatq's service packages, which a machine set up only to run models (PyTorch, transformers, Triton) need not have.
SERVICE_PACKAGES = (
    "celery",
    "fastapi",
    "gguf",
    "jsonschema",
    "kombu",
    "opentelemetry",
    "orjson",
    "prometheus_client",
    "pydantic",
    "pydantic_settings",
    "pythonjsonlogger",
    "redis",
    "sse_starlette",
    "standardwebhooks",
    "starlette",
    "uvicorn",
    "xgrammar",
)


def test_the_gpu_benchmark_runs_with_none_of_the_service_packages(tmp_path):
    # bench/gpu_engine.py in its quick mode on CPU, each service package hidden (None in sys.modules fails its import,
    # and importlib's find_spec reports it missing, as transformers checks).
    hide = "".join(f"sys.modules[{name!r}] = None; " for name in SERVICE_PACKAGES)
    code = f"import runpy, sys; {hide}runpy.run_path('bench/gpu_engine.py', run_name='__main__')"
    env = os.environ | {"MODELS": "tiny", "N": "4", "NEW": "4", "OUT": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((tmp_path / "engine_results.json").read_text())
    assert results["facts"]["check_against_transformers_graphs0"] is True
    assert results["facts"]["check_against_transformers_graphs4"] is True
    rows = [(r["model"], r["engine"], r["complete"]) for r in results["results"]]
    assert rows == [("tiny", "chatq", True), ("tiny", "chatq+4lora", True)]


def test_the_gpu_benchmarks_greedy_check_names_the_first_wrong_token(monkeypatch):
    from bench import gpu_engine

    class OneTokenOff(gpu_engine.Engine):
        def step(self):
            outputs = super().step()
            for o in outputs:
                if o.finish and o.seq.id == "1":
                    o.seq.output_ids[2] += 1
            return outputs

    assert gpu_engine.check_against_transformers(0) is True
    monkeypatch.setattr(gpu_engine, "Engine", OneTokenOff)
    differences = gpu_engine.check_against_transformers(0)
    assert isinstance(differences, dict) and list(differences) == ["1"]
    assert differences["1"].startswith("token 2: engine ")
