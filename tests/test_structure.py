"""The package's shape: no module imports its way back to itself, and its dependencies are
declared exactly as its code imports them. Both read the source with `ast` (every import
statement counts, lazy ones inside functions and type-checking ones included)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]  # the checkout: the package radixlm itself
NOT_PACKAGE = {"tests", "benchmarks", "examples", "build", "docs"}
# imported where present, never required (the import is guarded)
OPTIONAL = {"flash_attn"}
# a distribution whose import name differs from its name on the package registry
IMPORT_NAMES = {"outlines-core": "outlines_core"}


def package_modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or rel.parts[0] in NOT_PACKAGE or "egg-info" in str(rel):
            continue
        name = ".".join(("radixlm", *rel.with_suffix("").parts))
        modules[name.removesuffix(".__init__")] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """Every module name an import statement of the file names, relative ones resolved; for
    `from X import y`, X.y where that is one of `modules`, else X."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            subs = [f"{base}.{alias.name}" for alias in node.names]
            found += [sub if sub in modules else base for sub in subs]
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (a name inside a module counts as that module)"""
    modules = package_modules()

    def owner(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for target in imports_of(name, path, modules):
            found = owner(target) if target.startswith("radixlm") else None
            if found is not None and found != name:
                graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_module_of_the_package_imports_its_way_back_to_itself():
    graph = import_graph()
    assert len(graph) > 50 and graph["radixlm.runtime.engine_core"]  # the walk saw the package
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_dependencies_are_declared_exactly_as_imported():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = set()
    for requirement in project["dependencies"]:
        dist = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
        declared.add(IMPORT_NAMES.get(dist, dist.replace("-", "_")))
    imported = set()
    modules = package_modules()
    for name, path in modules.items():
        for target in imports_of(name, path, modules):
            top = target.split(".")[0]
            if top and top != "radixlm" and top not in sys.stdlib_module_names:
                imported.add(top)
    assert imported - OPTIONAL == declared, (
        f"imported, not declared: {sorted(imported - OPTIONAL - declared)}; "
        f"declared, never imported: {sorted(declared - imported)}"
    )


# the client side and the server reach the engine only through these (the engine process's
# bridge, which starts the engine in its own process)
ENGINE_BRIDGES = {"radixlm.server.engine_process"}


def test_the_client_side_and_the_server_import_no_engine_module():
    modules = package_modules()
    crossing = [
        f"{name} imports {target}"
        for name, path in sorted(modules.items())
        if name.startswith(("radixlm.lang", "radixlm.protocol", "radixlm.server"))
        and name not in ENGINE_BRIDGES
        for target in imports_of(name, path, modules)
        if target.startswith("radixlm.runtime")
    ]
    assert crossing == []


def test_programs_and_the_server_import_without_torch():
    """`radixlm.lang`, the protocol layer and the server's modules load with no torch: a client
    program or an HTTP front end never pays for the engine."""
    server = [name for name in package_modules() if name.startswith("radixlm.server")]
    code = (
        "import importlib, sys\n"
        f"for name in {['radixlm', 'radixlm.lang', 'radixlm.protocol', *server]!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_every_package_folder_is_installed():
    """A non-editable install takes the packages pyproject.toml lists: a folder of the package
    left out of that list would be missing from it."""
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {name for name, path in package_modules().items() if path.name == "__init__.py"}
    assert folders == listed
