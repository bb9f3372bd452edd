"""The package's structure: no import cycles among gossamer's modules."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gossamer"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(tree: ast.AST, name: str, is_package: bool, mods: set[str]) -> set[str]:
    """The gossamer modules `name` imports, at module level, inside functions or for type checking.

    `from p import m` imports the module p.m when there is one (p's __init__ has run, but an
    import of a submodule of the package being imported is no cycle through p), else p.
    """
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for a in node.names:
                out.add(f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module)
    found = set()
    for m in out:
        while m and m not in mods:  # `import a.b.X` where X is not a module: its package
            m = m.rpartition(".")[0]
        if m and m != name:
            found.add(m)
    return found


def import_graph() -> dict[str, set[str]]:
    """{module: the gossamer modules it imports}."""
    mods = _modules()
    return {name: _imports(ast.parse(path.read_text()), name, path.name == "__init__.py", set(mods))
            for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_cycles_in_gossamer() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles among gossamer modules:\n" + "\n".join(" <-> ".join(c) for c in found)


def private_imports() -> list[str]:
    """Imports of a private name (`from m import _x`) or of a private module from outside its package."""
    mods = _modules()
    found = []
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("gossamer"):
                continue
            module = node.module or ""
            for a in node.names:
                full = f"{module}.{a.name}"
                parts = full.split(".") if full in mods else module.split(".")
                private = next((i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__")), None)
                if private is not None and not name.startswith(".".join(parts[:private]) + "."):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {full}")
                elif full not in mods and a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {full}")
    return found


def test_no_private_name_imported_from_another_module() -> None:
    found = private_imports()
    assert not found, "private names imported from another module:\n" + "\n".join(found)
