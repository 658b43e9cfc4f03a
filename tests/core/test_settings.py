"""The one settings object: values out of range stop a process at start, paths take `~`, and Flower's login is
checked and handed on."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from chatq.cli import flower_env, main
from chatq.core.settings import Settings
from tests.helpers import ROOT


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


@pytest.mark.parametrize("auth", ["ops", "ops:", ":secret-pw", "ops:pw,admin"])
def test_a_flower_login_that_is_not_user_colon_password_is_refused_without_showing_it(auth, monkeypatch, capsys):
    monkeypatch.setenv("CHATQ_FLOWER_AUTH", auth)
    assert main(["job", "get", "x"]) == 2
    err = capsys.readouterr().err
    assert "CHATQ_FLOWER_AUTH" in err and auth not in err.split("CHATQ_FLOWER_AUTH", 1)[1]


def test_flower_gets_its_login_as_its_basic_auth_option():
    settings = Settings(flower_auth="ops:pw,admin:pw2")
    assert "pw" not in repr(settings) and "pw" not in str(settings.model_dump())
    assert flower_env(settings, {"A": "1"}) == {
        "A": "1",
        "FLOWER_BASIC_AUTH": "ops:pw,admin:pw2",
    }
    assert "FLOWER_BASIC_AUTH" not in flower_env(Settings(), {})


def test_every_setting_is_documented_with_its_default():
    """docs/configuration.md's table names each CHATQ_ variable beside its default."""
    table = [line for line in (ROOT / "docs" / "configuration.md").read_text().splitlines() if line.startswith("| `")]
    for name, field in Settings.model_fields.items():
        variable = f"`CHATQ_{name.upper()}`"
        rows = [line for line in table if variable in line.split("|")[1]]
        assert rows, f"{variable} is missing from docs/configuration.md"
        if field.default_factory is None and field.default is not None and not isinstance(field.default, Path):
            default = field.default.get_secret_value() if hasattr(field.default, "get_secret_value") else field.default
            default = int(default) if isinstance(default, float) and default.is_integer() else default
            assert (f"`{default}`" if default != "" else "empty") in rows[0].split("|")[2], variable


def test_the_deploying_guide_names_every_setting():
    guide = (ROOT / "docs" / "deploying.md").read_text()
    assert [n for n in Settings.model_fields if f"`CHATQ_{n.upper()}`" not in guide] == []


def test_the_files_directory_is_the_caches_unless_set(monkeypatch):
    monkeypatch.setenv("CHATQ_FILES_DIR", "")  # empty, as a compose file's unset ${VAR} gives it: not the working dir
    assert Settings(cache_dir="/data/chatq").files_path == Path("/data/chatq/files")
    monkeypatch.setenv("CHATQ_FILES_DIR", "~/uploads")
    assert Settings().files_path == Path.home() / "uploads"
