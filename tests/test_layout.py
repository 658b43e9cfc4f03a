"""The package's layout holds: imports run api -> core <- worker, and the API process never loads torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_imports_follow_the_layout():
    # The contracts are pyproject.toml's [tool.importlinter]: they follow imports through every module in between.
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "3 kept, 0 broken" in result.stdout


def test_the_api_process_loads_no_torch():
    code = "import sys, chatq.api.app; sys.exit(int('torch' in sys.modules or 'transformers' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
