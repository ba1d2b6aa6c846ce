"""The kernels package's import graph, read from the source (every import statement,
those inside functions included): no cycle; the engines (kernels.triton,
kernels.mosaic) import neither each other nor anything above them (kernels.dispatch,
the op packages); kernels.common imports no other kernels module; no module imports a
private (_-prefixed) name of another (shared helpers are public names of their owner)."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules():
    """{module name: path} of every kernels/*.py."""
    out = {}
    for d, _, files in os.walk(os.path.join(ROOT, "kernels")):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].split(os.sep)
                out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = os.path.join(d, f)
    return out


def _imports(path, modules):
    """The kernels modules `path` imports: `from P import m` counts P.m where that is a
    module, else P (every module's parent packages load first either way: not edges)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [s for s in subs if s in modules] or [node.module]
        found |= {n for n in names if n in modules}
    return found


def _graph():
    modules = _modules()
    return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def _cycle(graph):
    """A cycle of the graph as a list of modules, or None."""
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n, path + [n])
                if found:
                    return found
        state[m] = "done"
        return None
    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_no_cycle_and_engines_import_nothing_above_them():
    graph = _graph()
    assert {"kernels.dispatch", "kernels.triton.forward", "kernels.mosaic.forward"} <= set(graph)
    assert _cycle(graph) is None, _cycle(graph)
    above = {"kernels", "kernels.dispatch", "kernels.gdpa", "kernels.jagged_attention",
             "kernels.block_attention"}
    for m, deps in graph.items():
        if m.startswith("kernels.triton"):
            assert not {d for d in deps if d.startswith("kernels.mosaic") or d in above}, m
        if m.startswith("kernels.mosaic"):
            assert not {d for d in deps if d.startswith("kernels.triton") or d in above}, m
    assert graph["kernels.common"] == set()
    assert "kernels.triton.forward" in graph["kernels.dispatch"]
    assert "kernels.mosaic.forward" in graph["kernels.dispatch"]


def test_the_check_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _private_imports(source):
    """[(module, name)] of the `from module import _name` statements in source."""
    return [(node.module, a.name) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.module
            for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]


def test_no_private_name_crosses_a_file():
    found = {m: _private_imports(open(p).read()) for m, p in _modules().items()}
    assert not {m: f for m, f in found.items() if f}
    assert _private_imports("from kernels.triton.tile import F32, _dot\nimport os") == [
        ("kernels.triton.tile", "_dot")]
