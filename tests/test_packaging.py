"""The installed package holds product code only: test helpers (the real-cluster fixtures, fakes,
fault injection) live in tests/ and are never installed."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("gpupack", "deviceplugin", "extender", "draplugin")
TEST_ONLY_IMPORTS = {"pytest", "hypothesis", "realk8s", "faultproxy", "fake_nvml", "processes"}


def product_modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def test_no_test_only_modules_in_the_product_packages() -> None:
    offenders = [str(p.relative_to(REPO)) for p in product_modules()
                 if {"testing", "tests"} & set(p.parts) or p.stem.startswith(("fake", "test_", "conftest"))]  # fmt: skip
    assert offenders == []


def test_product_code_imports_no_test_tooling() -> None:
    offenders = []
    for p in product_modules():
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [
                f"{p.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in TEST_ONLY_IMPORTS
            ]
    assert offenders == []


# The components' modules: what the image runs. gpupack.simulate is the simulator's, run from a
# checkout or an install with the `simulate` extra.
RUNTIME_PACKAGES = ("extender", "deviceplugin", "draplugin", "gpupack")
SIMULATE_EXTRA = ("numpy", "matplotlib")
BLOCK_EXTRA = """
import importlib, importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, Block())
"""


def runtime_modules() -> list[str]:
    out = []
    for p in product_modules():
        rel = p.relative_to(REPO).with_suffix("")
        if rel.parts[:2] == ("gpupack", "simulate") or rel.name == "__main__":
            continue
        if rel.parts[0] in RUNTIME_PACKAGES:
            out.append(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))
    return out


def test_numpy_and_matplotlib_are_the_simulate_extras_only() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = [d.split(">")[0].split("=")[0].split("~")[0].strip() for d in project["dependencies"]]
    for extra in SIMULATE_EXTRA:
        assert extra not in deps
        assert any(d.startswith(extra) for d in project["optional-dependencies"]["simulate"])
    # what installs the checkout for the tests and `scripts/simulate` installs the charts too
    assert "'.[test,simulate]'" in (REPO / "scripts" / "bootstrap").read_text()
    # the image installs the package without extras
    assert not [
        ln for ln in (REPO / "Dockerfile").read_text().splitlines() if "pip install" in ln and "[" in ln
    ]


@pytest.mark.slow
def test_the_components_run_without_the_simulate_extra() -> None:
    import subprocess
    import sys

    mods = runtime_modules()
    assert {"extender.main", "deviceplugin.main", "draplugin.main", "extender.controllers.defrag.cli",
            "gpupack.certs"} <= set(mods)  # fmt: skip
    code = (
        f"BLOCKED = {SIMULATE_EXTRA!r}"
        + BLOCK_EXTRA
        + f"""
for m in {mods!r} + ["gpupack.simulate.chart"]:
    importlib.import_module(m)
assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED], "a component imported the extra"
from gpupack.simulate.chart import ChartUnavailable, fleet_chart
try:
    fleet_chart({{}}, None, "")
except ChartUnavailable as e:
    print("unavailable:", e)
from gpupack.simulate.cli import main
assert main([]) == 2
"""
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "pip install 'gpupack[simulate]'" in r.stdout
    assert "gpupack simulate needs numpy" in r.stderr


@pytest.mark.slow
def test_the_wheel_carries_the_type_markers_and_the_message_stubs(tmp_path: Path) -> None:
    # PEP 561: without py.typed (and api_pb2.pyi for the generated messages) a user's mypy sees Any
    # built from a copy: setuptools writes build/ beside the sources, and the checkout stays clean
    src = tmp_path / "src"
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in (*PACKAGES, "pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=junk)
        else:
            shutil.copy2(REPO / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(src)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("gpupack-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for pkg in PACKAGES:
        assert f"{pkg}/py.typed" in names
    assert "deviceplugin/api/api_pb2.pyi" in names
    # the DRA plugin's generated gRPC code (messages, their stubs, services) for every API it serves
    for api in ("dra_v1", "dra_v1beta1", "pluginregistration_v1", "dra_health_v1alpha1"):
        assert {
            f"draplugin/api/{api}_pb2.py",
            f"draplugin/api/{api}_pb2.pyi",
            f"draplugin/api/{api}_pb2_grpc.py",
        } <= names
    assert {"draplugin/main.py", "draplugin/metrics.py"} <= names
    assert not [n for n in names if n.startswith("tests/")]
