"""The one settings object: values out of range stop a process at start, and paths take `~`."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from chatq.cli import main
from chatq.core.settings import Settings


@pytest.mark.parametrize(("name", "value"), [("worker_ttl", 0), ("api_port", 70000), ("result_ttl", -1)])
def test_a_value_out_of_range_is_refused(name, value):
    with pytest.raises(pydantic.ValidationError):
        Settings(**{name: value})


def test_paths_take_the_home_directory():
    settings = Settings(cache_dir="~/chatq-cache", model="~/models/m")
    assert settings.cache_dir == Path.home() / "chatq-cache" and settings.model_dir == Path.home() / "models/m"


def test_the_command_names_the_variable_that_is_wrong(monkeypatch, capsys):
    monkeypatch.setenv("CHATQ_WORKER_TTL", "0")
    assert main(["job", "get", "x"]) == 2
    assert "chatq: CHATQ_WORKER_TTL: Input should be greater than or equal to 1" in capsys.readouterr().err


def test_the_admission_settings_are_settings_not_misspellings():
    from chatq.cli import unknown_variables

    environ = {"CHATQ_API_KEYS": "a,b", "CHATQ_API_KEY": "a", "CHATQ_MAX_QUEUED": "5", "CHATQ_MAX_BODY_BYTES": "9"}
    assert unknown_variables(environ | {"CHATQ_RENDER_THREADS": "2"}) == []


def test_api_keys_are_split_on_commas_and_hidden():
    settings = Settings(api_keys=" a , b,,")
    assert settings.api_key_list == ["a", "b"] and "a , b" not in repr(settings)
    assert Settings(api_keys="").api_key_list == []
