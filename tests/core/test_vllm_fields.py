"""Every field of vLLM's chat and legacy completion requests is honoured, refused by name, or listed in
docs/vllm-differences.md as not applying: none is accepted and silently ignored."""

import json
import re
import subprocess
from pathlib import Path

from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.completion_request import CompletionRequest
from chatq.core.requests import UNSUPPORTED_FIELDS
from tests.helpers import ROOT, vllm_venv

FIELDS = Path(__file__).with_name("vllm_request_fields.json")
DUMP = """
import json
from vllm import __version__
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
print(json.dumps({"vllm": __version__, "chat": sorted(ChatCompletionRequest.model_fields),
                  "completion": sorted(CompletionRequest.model_fields)}))
"""


def not_applying() -> set[str]:
    """The fields named in the differences page's "Fields that do not apply" section."""
    page = (ROOT / "docs" / "vllm-differences.md").read_text()
    section = page.split("## Fields that do not apply", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^- `(\w+)`", section, re.M))


def test_every_vllm_field_is_honoured_refused_or_listed():
    vllm = json.loads(FIELDS.read_text())
    listed = not_applying()
    for fields, model in ((vllm["chat"], ChatCompletionRequest), (vllm["completion"], CompletionRequest)):
        silent = [f for f in fields if f not in model.model_fields and f not in UNSUPPORTED_FIELDS and f not in listed]
        assert silent == [], f"{model.__name__} would accept and ignore vLLM's {silent}"


def test_the_listed_fields_are_not_honoured_too():
    honoured = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields) | set(UNSUPPORTED_FIELDS)
    assert not_applying() & honoured == set()


def test_the_field_list_is_the_installed_vllms():
    python = vllm_venv() / "bin" / "python"
    out = subprocess.run([str(python), "-c", DUMP], capture_output=True, text=True, timeout=600, check=True).stdout
    installed = json.loads(out.strip().splitlines()[-1])
    # When vLLM is upgraded, this file is rewritten from it and each new field gets its place above.
    assert installed == json.loads(FIELDS.read_text()), f"update {FIELDS.name} from vLLM {installed['vllm']}"
