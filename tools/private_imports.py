"""An import-linter contract type: no module imports another module's private names
(`from x import _name`). Registered in pyproject.toml ([tool.importlinter] contract_types) and run
by `lint-imports`: a name with a leading underscore is its module's own, so a module that needs
it from elsewhere asks for that name to be made public (or the code to move)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from grimp import ImportGraph
from importlinter import Contract, ContractCheck, fields, output


def _private_imports(path: Path, module: str) -> list[tuple[int, str, str]]:
    """(line, imported module, name) of each `from M import _name` in the file, M another module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.module == "__future__":
            continue
        if node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
            source = ".".join([*base, node.module] if node.module else base)
        else:
            source = node.module or ""
        for alias in node.names:
            name = alias.name
            if name.startswith("_") and not name.startswith("__") and source != module:
                out.append((node.lineno, source, name))
    return out


class PrivateImportsContract(Contract):
    """Options: `source_modules`, the packages whose modules are checked (their submodules too)."""

    source_modules = fields.ListField(subfield=fields.ModuleExpressionField())

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        roots = [str(m.expression) for m in self.source_modules]  # type: ignore[attr-defined]
        found: list[str] = []
        for module in sorted(graph.modules):
            if not any(module == r or module.startswith(r + ".") for r in roots):
                continue
            spec = importlib.util.find_spec(module)
            if spec is None or not spec.origin or not spec.origin.endswith(".py"):
                continue
            path = Path(spec.origin)
            for line, source, name in _private_imports(path, module):
                found.append(f"{module}:{line} imports {source}.{name}")
        return ContractCheck(kept=not found, metadata={"found": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for line in check.metadata["found"]:
            output.print_error(line, bold=False)
        output.new_line()
