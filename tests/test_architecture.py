"""The package's shape: its folders import each other without cycles, and the product never imports the tests'
fixture writers (a walk over every module's imports, read from the source)."""

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).parent.parent
PACKAGE_FOLDERS = {"mergeflow": "mergeflow", "tasks": "mergeflow.tasks", "flows": "mergeflow.flows", "deployments": "mergeflow.deployments"}
"""Each folder of the repo and the module name it is installed as."""


def module_files() -> dict[str, Path]:
    """Every installed module's name and source file."""
    found = {}
    for folder, package in PACKAGE_FOLDERS.items():
        for path in (REPO_ROOT / folder).rglob("*.py"):
            if folder == "mergeflow" and path.relative_to(REPO_ROOT / folder).parts[0] in PACKAGE_FOLDERS:
                continue
            parts = path.relative_to(REPO_ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package, *parts))] = path
    return found


def imported_modules(path: Path, module: str, known: set[str] = frozenset()) -> set[str]:
    """The absolute names of the modules a file imports (at any depth: lazy imports count); `from P import M`
    counts as an import of `P.M` where that is one of the `known` modules, else of `P`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).rstrip(".")
            names |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names}
    return names


def unit_of(module: str) -> str:
    """The unit whose imports must not cycle: a subpackage (`mergeflow.output`), or a module at the package's top
    (`mergeflow.cli`)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = {unit_of(name) for name in imported_modules(path, module, set(modules)) if name in modules}
        graph.setdefault(unit_of(module), set()).update(targets - {unit_of(module)})
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(unit: str) -> None:
        index[unit] = low[unit] = len(index)
        stack.append(unit)
        for other in graph.get(unit, ()):
            if other not in index:
                visit(other)
                low[unit] = min(low[unit], low[other])
            elif other in stack:
                low[unit] = min(low[unit], index[other])
        if low[unit] == index[unit]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == unit:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for unit in list(graph):
        if unit not in index:
            visit(unit)
    return found


def test_no_two_folders_import_each_other():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize("module", sorted(module_files()))
def test_the_product_never_imports_the_tests(module):
    imported = imported_modules(module_files()[module], module)

    assert not {name for name in imported if name.split(".")[0] in ("tests", "bench")}


def test_the_default_backend_is_a_registered_one():
    from mergeflow.formats.registry import BACKEND_NAMES
    from mergeflow.options import DEFAULT_BACKEND

    assert DEFAULT_BACKEND in BACKEND_NAMES


def test_each_backend_folder_exports_the_record_the_registry_lists():
    import importlib

    from mergeflow.formats.registry import BACKENDS

    folders = sorted(path.parent.name for path in (REPO_ROOT / "mergeflow" / "formats").glob("*/__init__.py"))
    records = [importlib.import_module(f"mergeflow.formats.{folder}").BACKEND for folder in folders]

    assert sorted(records, key=id) == sorted(BACKENDS, key=id)
