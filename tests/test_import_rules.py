"""docs/ARCHITECTURE.md's "who may import whom", checked on the imports the code really has (every `import` and
`from ... import`, at module level or inside a function, TYPE_CHECKING blocks included), and no circle of modules.
The way test_torch_free.py holds the gateway to its promise, for the whole tree."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "telemetry", "cache_store", "gateway", "kernels", "backend", "ops")
# package -> the packages of ours it may import (docs/ARCHITECTURE.md, "Layout")
ALLOWED = {
    "protocol": set(),
    "telemetry": set(),
    "cache_store": {"protocol"},
    "gateway": {"protocol", "telemetry", "cache_store"},
    "kernels": set(),
    "backend": {"protocol", "telemetry", "cache_store", "kernels"},
    "ops": {"protocol", "telemetry", "cache_store", "gateway", "backend"},
}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            name = ".".join(("edgeinfer", *parts)).removesuffix(".__init__")
            out[name] = f
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    def resolve(target: str) -> str | None:
        while target and target not in mods:
            target = target.rsplit(".", 1)[0] if "." in target else ""
        return target or None

    graph: dict[str, set[str]] = {}
    for name, f in mods.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                found |= {t for a in node.names if (t := resolve(a.name))}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    t = resolve(f"{node.module}.{a.name}") or resolve(node.module)
                    if t:
                        found.add(t)
        found.discard(name)
        graph[name] = found
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def package(module: str) -> str:
    return module.split(".")[1]


def test_every_import_runs_down_the_layout():
    graph = import_graph(modules())
    bad = sorted((a, b) for a, outs in graph.items() for b in outs
                 if package(a) != package(b) and package(b) not in ALLOWED[package(a)])
    assert bad == [], "imports against docs/ARCHITECTURE.md's layout: " + ", ".join(f"{a} -> {b}" for a, b in bad)
    assert sum(len(v) for v in graph.values()) > 200   # the graph was really read


# backend's rooms -> the rooms of backend (and the packages outside it) each may import (docs/ARCHITECTURE.md);
# backend's top-level modules (server, cli, config, metrics) wire the rooms together and may import any of them
BACKEND_ALLOWED = {
    "model": {"kernels", "protocol"},
    "engine": {"model", "kernels", "protocol"},
    "parallel": {"engine", "model", "kernels", "protocol"},
    "quant": {"model", "engine", "kernels", "protocol"},
    "page_store": {"engine", "cache_store", "protocol"},
}


def folder(module: str) -> str:
    """A module's room: its top-level package, or for backend its subpackage ("backend" for its own modules)."""
    parts = module.split(".")
    if parts[1] == "backend" and len(parts) > 3:
        return parts[2]
    return parts[1]


def test_every_import_inside_backend_runs_down_its_rooms():
    graph = import_graph(modules())
    bad = sorted((a, b) for a, outs in graph.items() for b in outs
                 if (fa := folder(a)) in BACKEND_ALLOWED and (fb := folder(b)) != fa
                 and fb not in BACKEND_ALLOWED[fa])
    assert bad == [], "imports against backend's rooms: " + ", ".join(f"{a} -> {b}" for a, b in bad)
    assert {folder(m) for m in graph} >= set(BACKEND_ALLOWED)     # every room was found


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, outs in graph.items():
        out.setdefault(folder(a), set()).update(folder(b) for b in outs if folder(b) != folder(a))
    return out


def test_no_loop_of_folders():
    """Rooms import down, never around (the old model -> quant -> engine -> model loop), counting imports inside
    functions and under TYPE_CHECKING."""
    found = circles(folder_graph(import_graph(modules())))
    assert found == [], f"folder loops: {found}"


def test_the_folder_loop_finder_finds_the_old_loop():
    graph = {"edgeinfer.backend.model.loader": {"edgeinfer.backend.quant.loader"},
             "edgeinfer.backend.quant.loader": {"edgeinfer.backend.quant.calib"},
             "edgeinfer.backend.quant.calib": {"edgeinfer.backend.engine.model_runner"},
             "edgeinfer.backend.engine.model_runner": {"edgeinfer.backend.model.batch"},
             "edgeinfer.backend.model.batch": set()}
    assert circles(folder_graph(graph)) == [["engine", "model", "quant"]]
    assert circles(graph) == []                        # no module circle: only the folders loop


def test_no_circle_of_modules():
    found = circles(import_graph(modules()))
    assert found == [], f"import circles: {found}"


def test_the_circle_finder_finds_circles():
    """The check above can fail: on a graph with a late import back up (the shape of the old prepack -> calib one)."""
    graph = {"model": {"kernels"}, "kernels": set(), "calib": {"runner"}, "runner": {"model"}}
    assert circles(graph) == []
    graph["model"].add("calib")
    assert circles(graph) == [["calib", "model", "runner"]]


def test_the_gateway_reads_the_default_tokenizer_without_importing_the_model(tmp_path, monkeypatch):
    """The gateway never touches model files: `tokenizer = "default"` is the built-in model's import, or a clear
    error naming the command that makes it."""
    import pytest

    from edgeinfer.gateway.served_model import resolve_tokenizer_dir
    from edgeinfer.protocol.defaults import native_default_dir

    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="run `edgeinfer model import`"):
        resolve_tokenizer_dir("default")
    native_default_dir().mkdir(parents=True)
    (native_default_dir() / "tokenizer.json").write_text("{}")
    assert resolve_tokenizer_dir("default") == tmp_path / "models" / "gguf-native" / "SmolLM2-135M-Instruct"
    assert resolve_tokenizer_dir("/some/dir") == Path("/some/dir")


def test_the_installed_packages_never_import_the_benchmarks_or_the_tests():
    """benchmarks/ and tests/ are not installed (pyproject packages only edgeinfer*): an import of either from a
    package would work in a checkout and fail for a user."""
    bad = []
    for name, f in modules().items():
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            bad += [f"{name} imports {t}" for t in targets if t.split(".")[0] in ("benchmarks", "tests")]
    assert not bad, bad


def test_the_engine_imports_no_concrete_model():
    """The engine sees a model through backend/model/paged.py's PagedModel only (the decoder and tensor
    parallelism's face both satisfy it), never backend/model/decoder.py."""
    graph = import_graph(modules())
    bad = sorted(a for a, outs in graph.items() if folder(a) == "engine" and "edgeinfer.backend.model.decoder" in outs)
    assert bad == [], f"the engine imports the concrete decoder: {bad}"


def private_reads(mods: dict[str, Path]) -> list[str]:
    """`x._name` read in one package (a backend room counts as one) of a private `_name` defined only in other
    packages (a `def _name`, a `_name = ...` at class or module level, a `self._name = ...`): a module reaching into
    another package's internals. `self._x` / `cls._x` and dunders are not counted."""
    defined: dict[str, set[str]] = {}
    reads: list[tuple[str, str, int]] = []
    for name, f in mods.items():
        room = folder(name)
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name.startswith("_"):
                defined.setdefault(node.name, set()).add(room)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(t, ast.Name) and t.id.startswith("_"):
                        defined.setdefault(t.id, set()).add(room)
                    elif isinstance(t, ast.Attribute) and t.attr.startswith("_"):
                        defined.setdefault(t.attr, set()).add(room)
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                reads.append((name, node.attr, node.lineno))
    return sorted({f"{m}:{line} ._{a[1:]}" for m, a, line in reads
                   if a in defined and folder(m) not in defined[a]})


def test_no_module_reads_another_packages_private_attribute():
    bad = private_reads(modules())
    assert bad == [], "private attributes read across packages: " + ", ".join(bad)


def test_the_private_read_check_finds_one(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("class E:\n    def __init__(self):\n        self._seqs = {}\n")
    b.write_text("def f(engine):\n    return engine._seqs\n")
    found = private_reads({"edgeinfer.backend.engine.e": a, "edgeinfer.backend.server": b})
    assert found == ["edgeinfer.backend.server:2 ._seqs"]
    assert private_reads({"edgeinfer.backend.engine.e": a, "edgeinfer.backend.engine.f": b}) == []


def test_no_file_in_backend_is_over_450_lines():
    """A file past this has grown several rooms' worth of work (the house step split engine.py and server.py)."""
    long = sorted((n, str(f.relative_to(ROOT))) for f in (ROOT / "backend").rglob("*.py")
                  if (n := f.read_text().count("\n")) > 450)
    assert long == [], f"backend files over 450 lines: {long}"
