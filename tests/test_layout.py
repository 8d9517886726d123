"""The library's layout: no import circle between its modules and no oversized file."""
from __future__ import annotations

import ast
import graphlib
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "trace"
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = path.relative_to(LIBRARY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _library_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(LIBRARY.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The library module `import name` loads (the longest known prefix), or None outside the library."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Every library module -> the library modules it imports anywhere in its body (also inside functions,
    and through ``importlib.import_module`` with a literal name).

    `from pkg import name` points at `pkg.name` when that is a module, else at `pkg`. Importing `pkg.sub`
    from outside `pkg` also runs `pkg/__init__.py`, so it points at `pkg` too; from inside `pkg` it does not
    (the package is already initialising).
    """
    modules = _library_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            targets: list[str] = []
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                targets = [str(node.args[0].value)]  # importlib.import_module("trace.x")
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is None:
                    continue
                parts = resolved.split(".")
                for depth in range(2, len(parts) + 1):
                    module = ".".join(parts[:depth])
                    inside = name == module or name.startswith(module + ".")
                    if module in modules and not inside:
                        graph[name].add(module)
    return graph


def test_library_modules_import_each_other_without_a_circle():
    try:
        order = list(graphlib.TopologicalSorter(import_graph()).static_order())
    except graphlib.CycleError as err:
        raise AssertionError(f"import circle in trace/: {' -> '.join(err.args[1])}") from None
    assert "trace.tree" in order


def test_the_import_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "trace.rollout" in graph["trace.training.loop"] or any("trace.rollout" in deps for deps in graph.values())


def test_no_library_file_is_longer_than_the_limit():
    long = {str(p.relative_to(LIBRARY.parent)): n for p in LIBRARY.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them by concern): {long}"
