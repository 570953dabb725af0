"""Imports inside `bem` run one way: no module imports (at its top, inside a function or for type checking) a module
that imports it back, directly or through others. A package's `__init__` re-exporting its modules is not a loop."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "bem"


def module_files() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The `bem` modules that `name` imports by relative or absolute import (a package itself only when a module
    outside it imports from it)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = {f"{target}.{alias.name}" for alias in node.names} & known
            if submodules:
                found |= submodules
            elif target in known and not name.startswith(target + "."):
                found.add(target)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
    found.discard(name)
    return found


def test_no_module_imports_one_that_imports_it_back():
    modules = module_files()
    graph = {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}
    loops = []

    def visit(name: str, trail: list[str]) -> None:
        for target in graph[name]:
            if target in trail:
                loops.append(trail[trail.index(target):] + [target])
            elif len(trail) < 12:
                visit(target, trail + [target])

    for start in graph:
        visit(start, [start])
    assert not loops, "import loops: " + "; ".join(" -> ".join(loop) for loop in loops[:5])


def test_the_files_that_read_and_write_adapters_never_import_the_model():
    modules = module_files()
    for name in ("bem.persistence", "bem.lora_bridge", "bem.stats"):
        assert "bem.model" not in imported_modules(name, modules[name], set(modules))
    for name in ("bem.modules.controller_graphs", "bem.modules.controller_heads"):
        assert "bem.modules.controller" not in imported_modules(name, modules[name], set(modules))
