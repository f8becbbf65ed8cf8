"""The shape of the code the design promises (../shared/DESIGN.md, docs/models.md), checked on
the source itself: no import cycles, the layering rules, small files, keyword-only arguments
for long signatures, and families, optimizers and converters found through their registries."""

from __future__ import annotations

import ast
import re
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


# --- rooms --------------------------------------------------------------------------------------

ROOT_MODULES = {
    # entry points and the modules that compose every layer
    "train": "python -m titanlite.train: parse, build the Trainer, run, map errors to exits",
    "trainer": "the set-up phases and the loop",
    "preflight": "python -m titanlite.preflight: the launcher's checks before any process",
    "dry_run": "the layout's per-rank estimate without training",
    "checks": "every check of a planned run, the components' rules included",
    "assembly": "the one function that builds a run's model",
    "components": "the registries and features composed into the config's catalog",
    # cross-cutting
    "errors": "UserError and every exit status",
    "files": "atomic writes",
    "paths": "where a configured path points",
    "dtypes": "dtype names",
}


def test_the_root_holds_only_entry_points_and_cross_cutting_modules() -> None:
    """Everything else lives in a room (a subpackage) named for what it owns."""
    root = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert root == set(ROOT_MODULES)


def declared_imports(package: Path) -> set[str] | None:
    """The titanlite modules a room's ``__init__`` docstring says it may import: the names
    in double backticks after "May import:" (relative to titanlite), or None without one."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    _, found, rest = doc.partition("May import:")
    if not found:
        return None
    paragraph = rest.split("\n\n")[0]
    return {
        f"titanlite.{name}" if name != "titanlite" else name
        for name in re.findall(r"``([a-z_][a-z_.]*)``", paragraph)
    }


def rooms() -> list[Path]:
    """titanlite's subpackages that are rooms (not a family's folder or a room's helper
    package): those whose __init__ says what they may import, and every top-level one."""
    top = [p.parent for p in PACKAGE.glob("*/__init__.py")]
    nested = [
        p.parent for p in PACKAGE.glob("*/*/__init__.py") if declared_imports(p.parent) is not None
    ]
    return sorted(top + nested)


def test_every_room_says_what_it_owns_and_may_import() -> None:
    missing = [str(p.relative_to(PACKAGE)) for p in rooms() if declared_imports(p) is None]
    assert missing == []


def test_rooms_import_only_what_their_docstring_allows() -> None:
    """A room's modules import, of titanlite, their own room and what its docstring lists
    (a nested room also its parent room's own modules, not the parent's other rooms)."""
    modules = source_files()
    graph = import_graph(packages=False)
    offenders = {}
    for room in rooms():
        name = module_name(room / "__init__.py")
        allowed = {name, *declared_imports(room)}
        parent = name.rpartition(".")[0]
        nested = {module_name(r / "__init__.py") for r in rooms() if r.parent == room}
        for module, imported in graph.items():
            if module != name and not module.startswith(name + "."):
                continue
            if any(module == n or module.startswith(n + ".") for n in nested):
                continue  # checked as its own room
            bad = sorted(
                i
                for i in imported
                if i in modules
                and not any(i == a or i.startswith(a + ".") for a in allowed)
                and not (parent != "titanlite" and i.rpartition(".")[0] == parent)
            )
            if bad:
                offenders[module] = bad
    assert offenders == {}


def test_the_room_check_finds_a_forbidden_import(tmp_path: Path) -> None:
    """The check above can fail: a docstring allowing less than the code imports."""
    room = tmp_path / "room"
    room.mkdir()
    (room / "__init__.py").write_text('"""A room.\n\nMay import: ``errors``.\n"""\n')
    assert declared_imports(room) == {"titanlite.errors"}
    (room / "__init__.py").write_text('"""A room without the line."""\n')
    assert declared_imports(room) is None
