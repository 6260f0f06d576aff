"""The installed package holds product code only: test helpers (the real-cluster fixtures, fakes,
fault injection) live in tests/ and are never installed."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("gpupack", "deviceplugin", "extender")
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
