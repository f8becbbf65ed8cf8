"""The shape of the code the design promises (../shared/DESIGN.md, docs/models.md), checked on
the source itself: no import cycles, the layering rules, small files, keyword-only arguments
for long signatures, and families, optimizers and converters found through their registries."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "titanlite"

MAX_LINES = 400
MAX_POSITIONAL = 4

# What titanlite.parallel may import of titanlite.models: the spec, the interfaces the
# parallelisms hook into, and the layout-invariant initializer; never a model class.
PARALLEL_MAY_IMPORT = {
    "titanlite.models.spec",
    "titanlite.models.interfaces",
    "titanlite.models.init",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (function-level and
    TYPE_CHECKING imports count: a cycle through them is a cycle in all but name).
    ``from package import name`` is an import of ``package.name`` when that is a module."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return found - {this}


def import_graph(packages: bool = True) -> dict[str, set[str]]:
    """Module -> the titanlite modules importing it runs. Importing ``pkg.mod`` from outside
    ``pkg`` runs ``pkg/__init__.py`` first, so that is an edge too (a module's own package is
    already being imported when it runs); ``packages`` False: the modules named only."""
    modules = source_files()
    graph = {}
    for name, path in modules.items():
        internal = set()
        for imported in imports_of(path, modules):
            while imported and imported not in modules:  # a name inside a module
                imported = imported.rpartition(".")[0]
            if not imported:  # not titanlite's
                continue
            internal.add(imported)
            while packages and imported:
                if not name.startswith(imported + "."):
                    internal.add(imported)
                imported = imported.rpartition(".")[0]
        graph[name] = internal - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_models_do_not_import_torch_distributed() -> None:
    modules = source_files()
    offenders = {
        name: sorted(i for i in imports_of(path, modules) if i.startswith("torch.distributed"))
        for name, path in modules.items()
        if name.startswith("titanlite.models")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_parallel_reaches_models_only_through_spec_and_interfaces() -> None:
    graph = import_graph(packages=False)
    offenders = {
        name: sorted(i for i in imported if i.startswith("titanlite.models"))
        for name, imported in graph.items()
        if name.startswith("titanlite.parallel")
    }
    assert {
        k: set(v) - PARALLEL_MAY_IMPORT
        for k, v in offenders.items()
        if set(v) - PARALLEL_MAY_IMPORT
    } == {}


def test_no_module_over_400_lines() -> None:
    sizes = {name: len(p.read_text().splitlines()) for name, p in source_files().items()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def long_positional_signatures() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            names = [a.arg for a in node.args.posonlyargs + node.args.args]
            if names and names[0] in ("self", "cls", "ctx"):
                names = names[1:]
            if len(names) > MAX_POSITIONAL:
                found.append(f"{module_name(path)}:{node.lineno} {node.name}({', '.join(names)})")
    return found


def test_long_signatures_take_keyword_only_arguments() -> None:
    """Two same-typed arguments (two dtype strings, two groups) cannot be swapped silently:
    a function takes at most four positional parameters, the rest by keyword."""
    assert long_positional_signatures() == []


# --- registries ---------------------------------------------------------------------------------


def test_every_family_folder_is_registered_and_needs_no_shim() -> None:
    """A family is one folder under models/ (its spec in __init__) and one registry line."""
    from titanlite import models

    folders = {
        p.parent.name for p in (PACKAGE / "models").glob("*/__init__.py") if "SPEC" in p.read_text()
    }
    registered = {spec.hf_module.split(".")[2] for spec in models.REGISTRY.values()}
    assert folders == registered
    for spec in models.REGISTRY.values():
        assert spec.implementation() is not None  # the modules its spec names import


@pytest.mark.parametrize("registry", ["models", "optim", "converters"])
def test_registries_import_without_torch(registry: str) -> None:
    """Config validation and the launcher's preflight read the registries without torch."""
    import subprocess
    import sys

    code = (
        f"import sys, titanlite.{registry} as r; r.REGISTRY; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent).returncode == 0
