"""The package's import graph: who imports whom, cycles, and imports against the layering.

    python tools/import_graph.py [PACKAGE_DIR]        # default: ddtree_numba next to this file

Reads the source with ``ast`` (nothing is imported), so it also runs on an old checkout. Edges
are between the package's own modules (a package counts as its ``__init__``); an import inside
a function is an edge too (marked ``lazy``), since it is a dependency all the same. Prints the
edges grouped by layer, the cycles among module-level imports, and every import from a lower
layer into a higher one. ``tests/test_layout.py`` asserts that both lists are empty.

The layers, lowest first (a module may import its own layer and the ones below):

0. ``limits``, ``arrays``: sizes and array kinds, nothing else of the package;
1. ``contracts``, ``interfaces``, ``validation``, ``paging``, ``kdtr``: the buffer contract;
2. ``reference``: the numpy definitions;
3. ``kernels``: the numba.cuda kernels;
4. ``step``: the device step (argmax / advance ops, GreedyStep), no model;
5. ``models``: targets and drafters (they may use the kernels and the step's interfaces);
6. everything else: the demo, plotting, fixtures, the build report, the command line.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LAYERS = [
    {"limits", "arrays", "_platform", "progress"},
    {"contracts", "interfaces", "validation", "paging", "kdtr"},
    {"reference"},
    {"kernels"},
    {"step"},
    {"models"},
]
TOP_LEVEL = {"step.demo"}   # modules placed in a package but belonging to the top layer


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def layer_of(name: str) -> int:
    if name in TOP_LEVEL:
        return len(LAYERS)
    head = name.split(".")[0]
    for i, names in enumerate(LAYERS):
        if head in names:
            return i
    return len(LAYERS)


def resolve(name: str, is_package: bool, node: ast.ImportFrom, known: set) -> list:
    """The package modules an ``from ... import ...`` statement names."""
    if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        if name == "__init__":
            base = []
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        stem = ".".join(base + ([node.module] if node.module else []))
    else:
        if not (node.module or "").startswith("ddtree_numba"):
            return []
        stem = node.module[len("ddtree_numba"):].lstrip(".")
    found = []
    for alias in node.names:
        full = f"{stem}.{alias.name}" if stem else alias.name
        if full in known:
            found.append(full)
        elif stem in known or stem == "":
            found.append(stem or "__init__")
    return found


def edges(root: Path) -> list:
    """``(importer, imported, lazy)`` for every import between the package's modules."""
    files = {module_name(p, root): p for p in root.rglob("*.py") if "__pycache__" not in p.parts}
    known = set(files)
    out = set()
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        top = set(map(id, tree.body))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom):
                targets = resolve(name, is_package, node, known)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("ddtree_numba."):
                        stem = alias.name[len("ddtree_numba."):]
                        targets += [stem] if stem in known else []
            lazy = id(node) not in top
            for target in targets:
                if target != name:
                    out.add((name, target, lazy))
    return sorted(out)


def cycles(graph_edges) -> list:
    """Cycles among module-level imports (Tarjan's strongly connected components)."""
    adj: dict = {}
    for a, b, lazy in graph_edges:
        if not lazy:
            adj.setdefault(a, set()).add(b)
            adj.setdefault(b, set())
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in adj[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(adj):
        if v not in index:
            visit(v)
    return comps


def upward(graph_edges) -> list:
    """Imports from a lower layer into a higher one (a package's ``__init__`` re-exporting its
    own submodules is not one)."""
    bad = []
    for a, b, lazy in graph_edges:
        if a == "__init__":
            continue                    # the package's front door re-exports from every layer
        if layer_of(b) > layer_of(a):
            bad.append((a, b, lazy))
    return bad


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "ddtree_numba"
    graph_edges = edges(root)
    by_layer: dict = {}
    for a, b, lazy in graph_edges:
        by_layer.setdefault(layer_of(a), []).append(f"  {a} -> {b}{' (lazy)' if lazy else ''}")
    for layer in sorted(by_layer):
        print(f"layer {layer}:")
        print("\n".join(by_layer[layer]))
    found_cycles, found_upward = cycles(graph_edges), upward(graph_edges)
    print(f"\n{len(graph_edges)} imports; cycles: {found_cycles or 'none'}")
    print("upward imports: " + (", ".join(f"{a} -> {b}{' (lazy)' if lazy else ''}"
                                         for a, b, lazy in found_upward) or "none"))
    return 1 if found_cycles or found_upward else 0


if __name__ == "__main__":
    sys.exit(main())
