"""The package's layout holds: imports run api -> core <- worker, the API process never loads torch, and the
architecture page names every module."""

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


def test_the_architecture_page_names_every_module():
    page = (ROOT / "docs" / "architecture.md").read_text()
    modules = [p for p in (ROOT / "chatq").rglob("*") if p.suffix in (".py", ".cpp") and p.name != "__init__.py"]
    assert modules
    assert [str(p.relative_to(ROOT)) for p in modules if p.name not in page] == []
