"""One version source: git tags via setuptools-scm, whose fallback_version names the release the deploy
manifests and the operator guide pin. Places that cannot read it are checked against it here."""

from __future__ import annotations

import re
import subprocess
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

import gpupack
from gpupack import cli

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
RELEASE = PYPROJECT["tool"]["setuptools_scm"]["fallback_version"]
KUSTOMIZATIONS = sorted(REPO.glob("deploy/**/kustomization.yaml"))


def test_the_version_is_not_written_in_pyproject_or_code() -> None:
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
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


def test_docs_name_the_release_image() -> None:
    text = (REPO / "docs" / "operator-guide.md").read_text()
    found = set(re.findall(r"gpupack:(\d+\.\d+\.\d+\S*)", text))
    found |= set(re.findall(r"newTag: (\d+\.\d+\.\d+\S*)", text))
    assert found <= {RELEASE}, f"operator guide names {found}, the release is {RELEASE}"


def test_the_newest_tag_is_the_release_the_manifests_pin() -> None:
    """Cutting a release means tagging it and moving fallback_version and the manifests with it."""
    try:
        p = subprocess.run(
            ["git", "describe", "--tags", "--abbrev=0", "--match", "v[0-9]*"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except FileNotFoundError:
        pytest.skip("no git")
    if p.returncode != 0:
        pytest.skip("no release tag in this clone (setuptools-scm counts from fallback_version)")
    assert p.stdout.strip().removeprefix("v") == RELEASE
