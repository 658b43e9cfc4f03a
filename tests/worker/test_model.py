"""Converting the shipped GGUF: once per machine, whichever of several workers starting together gets there first."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from chatq.worker.model import SHIPPED_SAMPLING, convert_gguf, ship_sampling, shipped_gguf


def test_a_worker_whose_conversion_another_finished_first_starts_with_that_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "model"
    rename = os.replace

    def another_worker_renamed_first(src: str | Path, dst: str | Path) -> None:
        # The other worker's rename lands between this one's last write and its own rename.
        if Path(dst) == target and not target.exists():
            shutil.copytree(src, target)
        rename(src, dst)

    monkeypatch.setattr(os, "replace", another_worker_renamed_first)
    convert_gguf(shipped_gguf(), target)
    assert (target / "config.json").exists() and (target / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # its own copy removed, nothing half-written left


def test_the_default_models_directory_gets_the_shipped_sampling_once_and_keeps_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    ship_sampling(tmp_path)  # a directory converted before the shipped sampling was
    assert json.loads(path.read_text()) == {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, **SHIPPED_SAMPLING}
    path.write_text(json.dumps({"temperature": 0.2, "top_p": 0.9}))  # shipped before the repetition penalty was
    ship_sampling(tmp_path)
    assert json.loads(path.read_text()) == {"do_sample": True, **SHIPPED_SAMPLING}
    path.write_text(json.dumps({"temperature": 0.7, "top_p": 0.8}))  # an operator's own choice stays
    ship_sampling(tmp_path)
    assert json.loads(path.read_text()) == {"temperature": 0.7, "top_p": 0.8}
    assert [p.name for p in tmp_path.iterdir()] == ["generation_config.json"]
