"""Converting the shipped GGUF: once per machine, whichever of several workers starting together gets there first."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from chatq.worker.model import convert_gguf, shipped_gguf


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
