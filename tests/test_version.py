"""One version source: `version` in pyproject.toml, the release the deploy manifests, the Helm chart
and the operator guide pin. Places that cannot read it are checked against
it here, and each component's first log line names the version."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

import gpupack
from gpupack import cli

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
RELEASE = PYPROJECT["project"]["version"]
KUSTOMIZATIONS = sorted(REPO.glob("deploy/**/kustomization.yaml"))


def test_the_version_is_written_once_in_pyproject_and_never_in_code() -> None:
    assert "version" not in PYPROJECT["project"].get("dynamic", [])
    assert re.fullmatch(r"\d+\.\d+\.\d+", RELEASE), RELEASE
    literal = re.compile(r"__version__\s*(:\s*str\s*)?=\s*['\"]\d+\.\d+")
    offenders = [
        str(p.relative_to(REPO))
        for pkg in ("gpupack", "deviceplugin", "extender")
        for p in (REPO / pkg).rglob("*.py")
        if literal.search(p.read_text())
    ]
    assert offenders == []


def test_dash_dash_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"gpupack {version('gpupack')}"
    assert gpupack.__version__ == version("gpupack")


def test_deploy_manifests_pin_the_release_image() -> None:
    tags = {}
    for k in KUSTOMIZATIONS:
        for image in yaml.safe_load(k.read_text()).get("images", []):
            if image["name"] == "gpupack":
                tags[str(k.relative_to(REPO))] = str(image["newTag"])
    assert tags, "no kustomization pins the gpupack image"
    assert tags == dict.fromkeys(tags, RELEASE)


def test_the_chart_installs_the_release() -> None:
    """The chart's appVersion is the image tag it installs by default; its own version moves with it
    (one number per release)."""
    chart = yaml.safe_load((REPO / "charts" / "gpupack" / "Chart.yaml").read_text())
    assert str(chart["appVersion"]) == RELEASE
    assert str(chart["version"]) == RELEASE


def test_dash_dash_version_names_the_chart_app_version(capsys: pytest.CaptureFixture[str]) -> None:
    """What a user reads from `gpupack --version` is the release the chart installs."""
    chart = yaml.safe_load((REPO / "charts" / "gpupack" / "Chart.yaml").read_text())
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"gpupack {chart['appVersion']}"


def test_docs_name_the_release_image() -> None:
    text = (REPO / "docs" / "operator-guide.md").read_text()
    found = set(re.findall(r"gpupack:(\d+\.\d+\.\d+\S*)", text))
    found |= set(re.findall(r"newTag: (\d+\.\d+\.\d+\S*)", text))
    assert found <= {RELEASE}, f"operator guide names {found}, the release is {RELEASE}"


# each component's start, stopped right after its logging is set up (by a bad option, or for the
# extender, whose flags are checked before logging so that a bad one is one line, a kubeconfig
# that does not load)
NO_KUBECONFIG = ["--kubeconfig", "/nonexistent", "--port", "0", "--metrics-port", "0"]
STARTS = {
    "extender": [sys.executable, "-m", "gpupack.cli", "extender", "--webhook-port", "0", *NO_KUBECONFIG],
    "webhook child": [
        sys.executable,
        "-m",
        "extender.main",
        "--role",
        "webhook",
        "--webhook-port",
        "0",
        *NO_KUBECONFIG,
    ],  # fmt: skip
    "device-plugin": [sys.executable, "-m", "gpupack.cli", "device-plugin", "--nvml-config", "x"],
    "defrag": [sys.executable, "-m", "gpupack.cli", "defrag", "--max-evictions", "-1"],
    "certs": [sys.executable, "-m", "gpupack.certs", "--namespace", ""],
}


@pytest.mark.parametrize("component", STARTS)
def test_each_components_first_log_line_names_the_version(component: str) -> None:
    # at level error too: the level cannot hide the version line
    env = {**os.environ, "GPUPACK_LOG_LEVEL": "error", "GPUPACK_LOG_FORMAT": "json"}
    p = subprocess.run(STARTS[component], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, p.stderr  # it stopped at the bad option, after logging was set up
    first = json.loads(p.stderr.splitlines()[0])
    want = {"extender": "extender", "webhook child": "extender"}.get(component, component)
    assert first["msg"] == f"gpupack {gpupack.__version__} {want} starting", first
    assert first["version"] == gpupack.__version__ and first["command"] == want
    if component == "webhook child":
        assert first["role"] == "webhook"
