"""The package's structure: layers imported one way, no import cycles, no private names across modules, no oversized functions or classes."""

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


#: gossamer's packages from the bottom up. A module may import its own package and any package of
#: a lower layer; two packages of one layer know nothing of each other. The package's own
#: `gossamer/__init__.py` (the public names) sits above them all.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("core",),  # shared definitions, free of torch at import: Experiment, modes, protocol, errors
    ("security", "v1"),  # credentials and channels; the generated control-plane API
    ("transport", "checkpoint"),  # the wire (frames, router, beats, HTTP); checkpoint files
    ("engine",),  # one rank: layouts, flat parameters, model, loss, batches, loaders
    ("compression",),
    ("paramserver",),
    ("training",),  # the rank loop, the train function, one folder per mode (sync, asynchronous, diloco, gossip)
    ("node", "coordinator"),
    ("tools", "examples"),  # the user's tools: CLI, client, demo, watch, plot, export
)
MAX_LOOSE_MODULES = 6


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations() -> list[str]:
    """Imports that run up the layer order or across one layer, TYPE_CHECKING and lazy ones included."""
    rank = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
    graph, mods = import_graph(), _modules()
    found = []
    for name, deps in sorted(graph.items()):
        src = _package(name)
        if not src:
            continue
        for dep in sorted(deps):
            dst = _package(dep)
            if dst == src:
                continue
            if not dst or dst not in rank or src not in rank or rank[dst] >= rank[src]:
                found.append(f"{mods[name].relative_to(PACKAGE.parent)} imports {dep}")
    return found


def test_packages_import_down_the_layers_only() -> None:
    rank = {pkg for layer in LAYERS for pkg in layer}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == rank, f"packages not in LAYERS: {sorted(packages - rank)}; gone: {sorted(rank - packages)}"
    found = layer_violations()
    assert not found, "imports against the layer order:\n" + "\n".join(found)


def test_no_two_packages_import_each_other() -> None:
    edges = {(_package(a), _package(b)) for a, deps in import_graph().items() for b in deps}
    mutual = sorted(f"{a} <-> {b}" for a, b in edges if a and b and a < b and (b, a) in edges)
    assert not mutual, mutual


def test_few_loose_modules_and_no_two_modules_share_a_name() -> None:
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= MAX_LOOSE_MODULES, loose
    by_name: dict[str, list[str]] = {}
    for p in PACKAGE.rglob("*.py"):
        if p.name != "__init__.py" and "v1" not in p.relative_to(PACKAGE).parts:
            by_name.setdefault(p.name, []).append(str(p.relative_to(PACKAGE.parent)))
    shared = {n: ps for n, ps in by_name.items() if len(ps) > 1}
    assert not shared, shared


def test_core_imports_no_torch_at_module_level() -> None:
    for path in sorted((PACKAGE / "core").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "torch" or n.startswith("torch.") for n in names), f"{path.name} imports torch"


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


MAX_FUNCTION_LINES = 100
MAX_CLASS_LINES = 600
#: Generated by `make proto` from protos/: not written by hand.
GENERATED = PACKAGE / "v1"


def test_no_function_over_100_lines_and_no_class_over_600() -> None:
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if GENERATED in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > MAX_FUNCTION_LINES:
                too_long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} function {node.name}: {lines} lines")
            elif isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                too_long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} class {node.name}: {lines} lines")
    assert not too_long, "\n".join(too_long)
