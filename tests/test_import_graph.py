"""The import graph of the library: packages in layers, no upward edges, no new cycles.

Read from the source (ast), imports inside functions and `from pkg import mod` included;
imports under `if TYPE_CHECKING:` are left out (they never run). A package may import
its own modules and any package listed before it in LAYERS, never one after it; so the
packages form no cycle. Modules form no import cycle either, apart from the cycles listed
in KNOWN_CYCLES (each broken today by an import inside a function).
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Bottom to top. "gemjax" is the package's own __init__ (its lazy attributes); distill
# trains students through train's Trainer and reads teachers through serve. "features"
# (the schema types) imports nothing of gemjax; config (the dataclasses and the synthetic
# stream's schema as a function of DataConfig) imports only features, so the data sources
# read their config and no config or model reaches a data source. "presets" (the named
# Configs and the real data's schemas) imports only config and features; the package's
# __init__ imports it to fill config.PRESETS.
LAYERS = ("checksums", "features", "parallel", "precision", "kernels", "config", "presets", "data", "sparse",
          "layers", "models", "perf", "train", "serve", "distill", "gemjax")

# Module cycles that exist today, each closed by an import inside a function.
KNOWN_CYCLES = (
    {"gemjax.data.parquet", "gemjax.data.source"},       # make_source picks the source class
)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, sub.end_lineno + 1))
    return lines


def imports(source: str, modules: set[str]) -> list[tuple[int, str]]:
    """(line, module) of every absolute import of `source`: `import a.b` -> a.b;
    `from a import b` -> a.b when that is a module of `modules`, else a."""
    tree = ast.parse(source)
    skip = _type_checking_lines(tree)
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            found = [m for m in subs if m in modules]
            out += [(node.lineno, m) for m in found]
            if len(found) < len(subs):
                out.append((node.lineno, node.module))
    return out


def layer_of(module: str) -> str | None:
    """gemjax.<pkg>... -> pkg (gemjax.config -> config), gemjax -> gemjax, kernels... ->
    kernels; None outside the library."""
    parts = module.split(".")
    if parts[0] == "kernels":
        return "kernels"
    if parts[0] != "gemjax":
        return None
    return parts[1] if len(parts) > 1 else "gemjax"


def library(root: pathlib.Path = ROOT) -> dict[str, str]:
    """{module name: source} of gemjax/ and kernels/."""
    out = {}
    for top in ("gemjax", "kernels"):
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text()
    return out


def graph(sources: dict[str, str]) -> dict[str, dict[str, int]]:
    """{module: {imported library module or package: line}}."""
    names = set(sources)
    return {m: {dep: line for line, dep in imports(src, names) if layer_of(dep) and dep != m}
            for m, src in sources.items()}


def upward_edges(g: dict[str, dict[str, int]]) -> list[str]:
    bad = []
    for m, deps in g.items():
        src = layer_of(m)
        if src not in LAYERS:
            bad.append(f"{m}: package {src!r} has no place in LAYERS")
            continue
        for dep, line in deps.items():
            dst = layer_of(dep)
            if dst not in LAYERS:
                bad.append(f"{m}:{line} imports {dep}: package {dst!r} has no place in LAYERS")
            elif LAYERS.index(dst) > LAYERS.index(src):
                bad.append(f"{m}:{line} imports {dep} ({src} < {dst})")
    return bad


def cycles(g: dict[str, dict[str, int]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, {}):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_packages_import_only_downwards():
    g = graph(library())
    assert len(g) > 60 and {"gemjax.parallel.mesh", "gemjax.perf.model_flops"} <= set(g)
    assert upward_edges(g) == []
    # the rules the issue names: parallel imports nothing else of gemjax; the accounting
    # (perf) reads the models, the models never read it
    assert not [d for m, deps in g.items() if m.startswith("gemjax.parallel") for d in deps
                if layer_of(d) != "parallel"]
    assert "gemjax.models.interformer" in g["gemjax.perf.model_flops"]
    assert "gemjax.perf.model_flops" in g["gemjax.perf.local_mfu"]


def reachable(g: dict[str, dict[str, int]], starts) -> set[str]:
    """Library modules imported, directly or not, by the modules `starts`."""
    seen, todo = set(), list(starts)
    while todo:
        for dep in g.get(todo.pop(), {}):
            if dep in g and dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


# What of data/ a config, the schema, a model or a layer may reach: the batch containers,
# never a source (the schema comes from the config, not from the stream).
DATA_CONTAINERS = {"gemjax.data.batch", "gemjax.data.jagged"}


def test_the_schema_and_the_models_reach_no_data_source():
    g = graph(library())
    assert [d for d in g["gemjax.features"] if layer_of(d)] == [], "features imports gemjax"
    assert set(g["gemjax.config"]) == {"gemjax.features"}
    assert set(g["gemjax.presets"]) == {"gemjax.config", "gemjax.features"}
    starts = ["gemjax.config", "gemjax.features", "gemjax.presets"] + [m for m in g if layer_of(m) in ("models", "layers")]
    assert len(starts) > 15
    reached = {m for m in reachable(g, starts) if layer_of(m) == "data"}
    assert reached <= DATA_CONTAINERS, sorted(reached - DATA_CONTAINERS)
    # through an import inside a function too
    planted = graph({"gemjax.models.m": "from gemjax.features import T\n",
                     "gemjax.features": "def f():\n    from gemjax.data import synthetic\n",
                     "gemjax.data.synthetic": ""})
    assert reachable(planted, ["gemjax.models.m"]) == {"gemjax.features", "gemjax.data.synthetic"}


def test_no_new_module_cycles():
    found = cycles(graph(library()))
    new = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert new == [], "import cycles between modules"


def test_the_checks_can_fail():
    """Planted edges: an upward import inside a function, `from pkg import module`, a
    TYPE_CHECKING import (ignored), a package outside LAYERS, a two-module cycle."""
    planted = {
        "gemjax.parallel.mesh": "def f():\n    from gemjax.train import step\n",
        "gemjax.data.batch": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from gemjax.config import Config\n",
        "gemjax.train.step": "import gemjax.perf.mfu\n",
        "gemjax.train": "",
        "gemjax.perf.mfu": "from gemjax.train import step\n",
        "gemjax.newpkg.x": "import numpy\n",
        "gemjax.config": "",
        "gemjax.perf": "",
    }
    g = graph(planted)
    assert g["gemjax.parallel.mesh"] == {"gemjax.train.step": 2}
    assert g["gemjax.data.batch"] == {}
    assert upward_edges(g) == ["gemjax.parallel.mesh:2 imports gemjax.train.step (parallel < train)",
                               "gemjax.perf.mfu:1 imports gemjax.train.step (perf < train)",
                               "gemjax.newpkg.x: package 'newpkg' has no place in LAYERS"]
    assert cycles(g) == [{"gemjax.train.step", "gemjax.perf.mfu"}]


def implicit_state(source: str) -> list[str]:
    """'line: what' for each thread-local or context-variable use in `source` (ast):
    threading.local / `from threading import local`, any import of contextvars or
    ContextVar. The library's settings are explicit (arguments, module attributes)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("local", "ContextVar") and \
                ast.unparse(node.value) in ("threading", "_thread", "contextvars"):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Import):
            out += [f"{node.lineno}: import {a.name}" for a in node.names if a.name == "contextvars"]
        elif isinstance(node, ast.ImportFrom) and node.module in ("threading", "_thread", "contextvars"):
            out += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                    if node.module == "contextvars" or a.name == "local"]
        elif isinstance(node, ast.Name) and node.id == "ContextVar":
            out.append(f"{node.lineno}: ContextVar")
    return out


def test_no_thread_local_or_context_variable_settings():
    found = {m: hits for m, src in library().items() if (hits := implicit_state(src))}
    assert found == {}, "thread-local / context-variable state in the library"
    # the check sees each form (and leaves locks, events and threads alone)
    assert implicit_state("import threading\n_s = threading.local()\n") == ["2: threading.local"]
    assert implicit_state("from threading import Lock, local\n") == ["1: from threading import local"]
    assert implicit_state("import contextvars\nv = contextvars.ContextVar('v')\n") == [
        "1: import contextvars", "2: contextvars.ContextVar"]
    assert implicit_state("from contextvars import ContextVar\nv = ContextVar('v')\n") == [
        "1: from contextvars import ContextVar", "2: ContextVar"]
    assert implicit_state("import threading\nlock = threading.Lock()\nthreading.Event()\n") == []
