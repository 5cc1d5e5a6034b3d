"""The package's imports hold to docs/architecture.md: no import cycle between files, each room imports only
the rooms its row of the "may import" table names, plugins/ imports no TensorRT, the op set's rooms and the
float64 oracle never import each other, and an import inside a function says why in a comment.

Every `import` counts, including those inside functions: a lazy import is still a dependency."""
import ast
import re
from pathlib import Path

import ddtree

ROOT = Path(ddtree.__file__).resolve().parent
TABLE = ROOT.parent / "docs/architecture.md"


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_of(p): p for p in ROOT.rglob("*.py")}


def room_of(module: str) -> str:
    """ddtree.<pkg>.x -> pkg; ddtree.<module> -> module; ddtree -> 'ddtree'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "ddtree"


def imports(path: Path) -> list[tuple[str, ast.stmt, bool]]:
    """(the ddtree module or third-party name imported, its node, inside a function) for every import of a file;
    `from pkg import mod` names the module mod where it is one."""
    out = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, child, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:                                   # relative: resolve against the file's package
                    base = path.relative_to(ROOT.parent).with_suffix("").parts[:-child.level]
                    module = ".".join(base + ((child.module,) if child.module else ()))
                else:
                    module = child.module
                for a in child.names:
                    full = f"{module}.{a.name}"
                    out.append((full if full in MODULES else module, child, in_function))
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return out


def ddtree_module(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def file_graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for m, path in MODULES.items():
        for name, _, _ in imports(path):
            target = ddtree_module(name) if name.startswith("ddtree") else None
            if target and target != m:
                graph[m].add(target)
    return graph


def cycles(graph: dict[str, set]) -> list[list[str]]:
    """Every strongly connected set of more than one node (Tarjan), each as a sorted list."""
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


def may_import() -> dict[str, set[str]]:
    """docs/architecture.md's rooms table: room -> the rooms it may import (the backticked names before any ';')."""
    rows = {}
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        room = cells[0].strip("`").rstrip("/")
        allowed = cells[2].split(";")[0]
        rows[room] = set() if allowed.strip() == "nothing" else set(re.findall(r"`([\w]+)`", allowed))
    return rows


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_are_read_from_the_tree():
    graph = file_graph()
    assert "ddtree.model.config" in graph["ddtree.reference.model"]          # a known edge: the oracle's config
    assert "ddtree.description.layers" in graph["ddtree.description.stack"]
    lazy = [n for n, _, inside in imports(MODULES["ddtree.runtime.engine"]) if inside]
    assert "ddtree.runtime.graph_executor" in lazy                            # a known lazy import is seen


def test_no_import_cycle_between_files():
    found = cycles(file_graph())
    assert not found, "file import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_every_room_has_a_row_and_imports_only_what_its_row_allows():
    table = may_import()
    rooms = {room_of(m) for m in MODULES}
    assert rooms <= set(table), f"rooms without a row in {TABLE.name}: {sorted(rooms - set(table))}"
    assert set(table) <= rooms, f"rows of {TABLE.name} that are no room: {sorted(set(table) - rooms)}"
    wrong = {}
    for m, targets in file_graph().items():
        for t in targets:
            src, dst = room_of(m), room_of(t)
            if src != dst and dst not in table[src]:
                wrong.setdefault(f"{src} -> {dst}", []).append(m)
    assert not wrong, f"imports outside {TABLE.name}'s table: {wrong}"


def test_the_table_parser_reads_the_rows():
    table = may_import()
    assert table["reference"] == {"model"} and table["data"] == set()
    assert "runtime" in table["server"] and "fastapi" not in table["server"]


def test_plugins_import_no_tensorrt():
    trt = sorted(m for m, p in MODULES.items() if room_of(m) == "plugins"
                 and any(n.split(".")[0].startswith("tensorrt") for n, _, _ in imports(p)))
    assert not trt, f"ddtree/plugins imports TensorRT: {trt}"


def test_the_op_set_and_the_oracle_are_independent():
    edges = {(room_of(m), room_of(t)) for m, ts in file_graph().items() for t in ts}
    for room in ("description", "backends"):
        assert (room, "reference") not in edges and ("reference", room) not in edges


def test_an_import_inside_a_function_says_why():
    """A lazy import is for an optional extra or a heavy module: a comment on its line (or the line above,
    or the first line of a group of imports) says which."""
    bare = []
    for m, path in MODULES.items():
        lines = path.read_text().splitlines()
        for _, node, inside in imports(path):
            if not inside:
                continue
            i = node.lineno - 1
            group = i
            while group > 0 and lines[group - 1].strip().startswith(("import ", "from ")):
                group -= 1
            said = any("#" in lines[j] for j in {i, node.end_lineno - 1, max(group - 1, 0), group})
            if not said:
                bare.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert not bare, f"{len(bare)} imports inside functions with no comment saying why: {sorted(set(bare))[:40]}"
