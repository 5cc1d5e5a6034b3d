"""The package's rooms import each other in one direction only: no cycle between top-level packages
(ddtree/<pkg>/, or a top-level module such as ddtree/jsonout.py), and plugins/ (the CUDA kernels,
their launchers and layouts) imports nothing from the rooms built on top of it, nor TensorRT, nor the
oracle. The op set (ops/, the model written once) and the float64 oracle (reference/) never import
each other: the oracle checks the op set only if the two are independent.

Every `import` counts, including those inside functions: a lazy import is still a dependency."""
import ast
from pathlib import Path

import ddtree

ROOT = Path(ddtree.__file__).resolve().parent
ABOVE_PLUGINS = {"ops", "runtime", "builder", "bench", "reference"}


def room_of(path: Path) -> str:
    """ddtree/<pkg>/... -> pkg; ddtree/<module>.py -> module; ddtree/__init__.py -> 'ddtree'."""
    rel = path.relative_to(ROOT).parts
    return rel[0] if len(rel) > 1 else ("ddtree" if rel[0] == "__init__.py" else rel[0][:-3])


def imported_modules(path: Path) -> set[str]:
    """Absolute module names a file imports (`from ddtree import x` counts as ddtree.x)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:                                    # relative: resolve against the file's package
                base = path.relative_to(ROOT.parent).with_suffix("").parts[:-node.level]
                module = ".".join(base + ((node.module,) if node.module else ()))
            else:
                module = node.module
            out.add(module)
            out |= {f"{module}.{a.name}" for a in node.names}
    return out


def room_imports() -> dict[str, dict[str, set[str]]]:
    """room -> {room it imports -> the files that do}."""
    rooms = {room_of(p) for p in ROOT.rglob("*.py")}
    graph: dict[str, dict[str, set[str]]] = {r: {} for r in rooms}
    for path in sorted(ROOT.rglob("*.py")):
        src = room_of(path)
        for module in imported_modules(path):
            parts = module.split(".")
            if parts[0] == "ddtree" and len(parts) > 1 and parts[1] in rooms and parts[1] != src:
                graph[src].setdefault(parts[1], set()).add(str(path.relative_to(ROOT.parent)))
    return graph


def cycles(graph: dict[str, dict]) -> list[list[str]]:
    """Every strongly connected set of more than one room (Tarjan), each as a sorted list."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
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
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_imports_are_read_from_the_tree():
    graph = room_imports()
    assert {"plugins", "ops", "runtime", "builder", "model", "reference"} <= set(graph)
    assert "model" in graph["reference"]                     # a known edge: the oracle reads the config


def test_no_package_cycles():
    graph = room_imports()
    found = cycles(graph)
    detail = [" <-> ".join(c) + ": " + "; ".join(f"{a} -> {b} in {sorted(graph[a][b])}" for a in c for b in c
                                                if b in graph[a]) for c in found]
    assert not found, "package import cycles:\n" + "\n".join(detail)


def test_plugins_import_only_what_lies_below_them():
    graph = room_imports()
    above = {room: sorted(files) for room, files in graph["plugins"].items() if room in ABOVE_PLUGINS}
    assert not above, f"ddtree/plugins imports packages built on top of it: {above}"
    trt = sorted(str(p.relative_to(ROOT.parent)) for p in (ROOT / "plugins").rglob("*.py")
                 if any(m.split(".")[0].startswith("tensorrt") for m in imported_modules(p)))
    assert not trt, f"ddtree/plugins imports TensorRT: {trt}"


def test_the_op_set_and_the_oracle_are_independent():
    graph = room_imports()
    assert "reference" not in graph["ops"], f"ops imports the oracle: {sorted(graph['ops'].get('reference', []))}"
    assert "ops" not in graph["reference"], f"the oracle imports ops: {sorted(graph['reference'].get('ops', []))}"
