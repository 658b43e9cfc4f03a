"""Every torch build the project tells someone to install exists: the GPU image, the Makefile, the docs.

PyTorch's index cannot be reached from here, so the builds are those of PyTorch's release matrix (RELEASE.md's
"Release Compatibility Matrix" and each release's announcement): 2.12 and 2.13 dropped CUDA 12.8 and publish 12.6 and
13.0 (13.2 as experimental), beside the CPU build.
"""

from __future__ import annotations

import re

from tests.helpers import ROOT

PUBLISHED = {
    "2.12.0": {"cpu", "cu126", "cu130", "cu132"},
    "2.13.0": {"cpu", "cu126", "cu130", "cu132"},
}
# A build's CUDA version, and the oldest NVIDIA driver that runs it (CUDA's minor-version compatibility).
DRIVER_FLOOR = {"cu126": 525, "cu130": 580, "cu132": 580}
INSTALL = re.compile(r"torch==([\d.]+) --index-url https://download\.pytorch\.org/whl/(\w+)")


def instructions() -> dict[str, list[tuple[str, str]]]:
    """Each file's torch installs: (version, build)."""
    files = [ROOT / "Dockerfile", ROOT / "docker-compose.yml", ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.md"))]
    return {f.name: INSTALL.findall(f.read_text()) for f in files}


def test_every_torch_build_named_is_one_pytorch_publishes():
    named = {(name, v, b) for name, found in instructions().items() for v, b in found}
    assert {name for name, _, _ in named} >= {"Dockerfile", "docker-compose.yml", "deploying.md", "gpu.md"}
    assert [n for n in named if n[2] not in PUBLISHED.get(n[1], set())] == []


def test_the_gpu_image_names_its_driver_floor_beside_its_build():
    compose = (ROOT / "docker-compose.yml").read_text()
    builds = {b for _, b in INSTALL.findall(compose)}
    assert builds == {"cu130"}
    assert f"driver of {DRIVER_FLOOR['cu130']} or newer" in compose
    guide = (ROOT / "docs" / "gpu.md").read_text()
    for build, floor in DRIVER_FLOOR.items():
        if build in guide:
            assert re.search(rf"{build}\b.*\b{floor}\b", guide), f"docs/gpu.md names {build} without its driver floor"
