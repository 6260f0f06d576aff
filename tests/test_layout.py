"""The extender stays a house a newcomer can find their way in: no module over 600 lines and no
class over 400 (docs/architecture.md lists each module's one responsibility)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE_MAX, CLASS_MAX = 600, 400
MODULES = sorted((ROOT / "extender").rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_and_class_sizes(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count("\n") <= MODULE_MAX, f"{path.name}: over {MODULE_MAX} lines; split it by responsibility"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            assert size <= CLASS_MAX, f"{path.name}: class {node.name} has {size} lines (at most {CLASS_MAX})"


def test_every_extender_module_is_on_the_map() -> None:
    """docs/architecture.md names every module of the extender by its place in the role folders
    (`verbs/filtering.py`), in its one-sentence table; the defragmenter's package is mapped in
    docs/defrag.md."""
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    ext = ROOT / "extender"
    defrag = ext / "controllers" / "defrag"
    missing = [
        str(p.relative_to(ext))
        for p in ext.rglob("*.py")
        if p.name != "__init__.py" and defrag not in p.parents and f"`{p.relative_to(ext)}`" not in doc
    ]
    assert not missing, f"docs/architecture.md does not say what these extender modules do: {missing}"


def test_extender_modules_live_in_role_folders() -> None:
    """Only the commands sit at the top of the extender; every other module is in the folder of
    its layer (the layers contract in pyproject.toml checks what each folder may import)."""
    top = sorted(p.name for p in (ROOT / "extender").glob("*.py") if p.name != "__init__.py")
    assert top == ["main.py", "status_cli.py"], top
    folders = sorted(p.name for p in (ROOT / "extender").iterdir() if (p / "__init__.py").is_file())
    assert folders == ["api", "controllers", "serve", "state", "verbs"], folders
