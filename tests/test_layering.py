"""The package's imports form layers with no cycle, and nothing edits sys.path.

Each concept is one unit: ``runtime.<concept>`` for the engine's subpackages, then ``ops``,
``graphs``, ``tools`` and the package root. A unit may import only units of a lower layer
(its own modules aside). Every import counts, those inside functions too: a lazy import is
still an edge of the layering.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("runtime", "ops", "graphs", "tools")

# The layers, bottom first. The model (config, tensor names, checkpoint formats) is data about
# DeepSeek-V4 that imports only the errors (and the device check its loader takes), so the
# declared graphs may read its config.
LAYERS = [
    {"runtime.errors"},
    {"runtime.device"},
    {"runtime.ir", "runtime.model", "runtime.native"},
    {"runtime.planning", "runtime.passes", "ops"},
    {"graphs"},
    {"runtime.execution"},
    {"runtime.cache"},
    {"runtime.proposer"},
    {"runtime.decode"},
    {"tools"},
    {"draftgraph"},
]
# The rules the layers must keep in any case, as the design states them.
NEVER = {
    "runtime.ir": {"ops", "graphs", "runtime.planning"},
    "runtime.planning": {"ops", "graphs"},
    "ops": {"graphs", "runtime.planning", "runtime.execution", "runtime.cache", "runtime.proposer"},
}


@functools.cache
def module_files() -> dict[str, Path]:
    files = {"draftgraph": ROOT / "__init__.py"}
    for top in PACKAGE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(["draftgraph", *parts])] = path
    return files


def unit_of(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "draftgraph"
    if parts[0] == "runtime" and len(parts) > 1:
        return f"runtime.{parts[1]}"
    return parts[0]


def imported_modules(module: str, path: Path) -> list[tuple[str, int]]:
    """(draftgraph module, line) for every import in ``path``, relative ones resolved.

    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module.
    """
    known = module_files()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        found += [(name, node.lineno) for name in names if name.split(".")[0] == "draftgraph"]
    return found


def unit_edges() -> dict[tuple[str, str], list[str]]:
    """(importer unit, imported unit) -> the import sites, ``file:line``."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, path in module_files().items():
        for target, line in imported_modules(module, path):
            a, b = unit_of(module), unit_of(target)
            if a != b:
                edges.setdefault((a, b), []).append(f"{path.relative_to(ROOT)}:{line}")
    return edges


def layer_of(unit: str) -> int:
    for index, units in enumerate(LAYERS):
        if unit in units:
            return index
    raise AssertionError(f"unit {unit!r}: expected a place in LAYERS, got none (hint: add the new subpackage there)")


def test_every_unit_imports_only_lower_layers():
    wrong = [f"{a} -> {b} ({', '.join(sites)})" for (a, b), sites in sorted(unit_edges().items())
             if layer_of(b) >= layer_of(a)]
    assert not wrong, "imports against the layering:\n  " + "\n  ".join(wrong)


def test_the_ir_planner_and_ops_keep_their_design_rules():
    wrong = [f"{a} -> {b} ({', '.join(sites)})" for (a, b), sites in sorted(unit_edges().items())
             if b in NEVER.get(a, ())]
    assert not wrong, "\n  ".join(["imports the design forbids:", *wrong])


def test_the_units_import_graph_has_no_cycle():
    graph = nx.DiGraph(list(unit_edges()))
    assert nx.is_directed_acyclic_graph(graph), f"unit import cycle: {nx.find_cycle(graph)}"


def test_every_subpackage_is_a_unit_with_a_layer():
    subpackages = {p.parent.name for p in (ROOT / "runtime").glob("*/__init__.py")}
    placed = {u.split(".", 1)[1] for layer in LAYERS for u in layer if u.startswith("runtime.")}
    assert subpackages <= placed, f"runtime subpackages without a layer: {sorted(subpackages - placed)}"


def test_no_file_edits_sys_path():
    offenders = []
    folders = (*PACKAGE_DIRS, "tests", "benchmarks")
    sources = [*ROOT.glob("*.py"), *(p for top in folders for p in (ROOT / top).rglob("*.py"))]
    for path in sorted(sources):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"sys.path used at: {offenders}"


def test_inside_the_package_every_import_is_package_qualified():
    bare = []
    for path in module_files().values():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            bare += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in PACKAGE_DIRS]
    assert not bare, f"imports of the bare folders (runtime, ops, graphs, tools): {bare}"
