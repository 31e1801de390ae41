"""The package import graph: no cycles, and the layer rules of ARCHITECTURE.md.

The graph is read from the source with `ast`: every `import` / `from ... import` of every module
of inference_engine, kv_cache_proposer, kakeya_research (research strategies, plugged in through
the kv registry), kakeya (the SDK) and kakeya_wire (the stubs and the rules
the daemon and the SDK share; the daemon never imports the SDK), at module
level and inside functions alike (a local import hides a cycle, it does not remove it). Imports
under `if TYPE_CHECKING:` never run and are left out. Whether a layer loads a framework at import
time is checked for real, in a fresh interpreter.
"""
from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {
    "inference_engine": ROOT / "inference_engine",
    "kv_cache_proposer": ROOT / "kv_cache_proposer",
    "kakeya_research": ROOT / "kakeya_research",
    "kakeya": ROOT / "sdks" / "python" / "kakeya",
    "kakeya_wire": ROOT / "wire" / "python" / "kakeya_wire",
}
FRAMEWORKS = ("torch", "mlx", "transformers")


def _module_files() -> dict[str, pathlib.Path]:
    out = {}
    for pkg, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            if any(part in ("checkpoints", "__pycache__") for part in rel.parts):
                continue
            parts = [pkg, *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _module_files()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(module: str, path: pathlib.Path) -> list[str]:
    """Every dotted name `module` imports, made absolute."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            # `from pkg import sub` loads pkg.sub (pkg, its parent, is loaded by any submodule
            # anyway); `from pkg import name` and `*` read pkg's own namespace.
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                names.append(sub if alias.name != "*" and sub in MODULES else source)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return names


def _resolve(name: str) -> str | None:
    """The most specific module of ours that importing `name` loads (None: not ours)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in MODULES:
            return candidate
    return None


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between our modules, top-level external packages each module imports)."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    external: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for name in _imported_names(module, path):
            target = _resolve(name)
            if target is None:
                top = name.split(".")[0]
                if top and top not in PACKAGES:
                    external[module].add(top)
            elif target != module:
                edges[module].add(target)
    return edges, external


EDGES, EXTERNAL = _graph()


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strongconnect(w)
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges)))
    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    return found


def _closure(start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for w in EDGES[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _where(modules, banned: tuple[str, ...]) -> dict[str, list[str]]:
    """{module: the banned top-level packages it imports}, for the modules that import any."""
    return {m: sorted(EXTERNAL[m] & set(banned)) for m in sorted(modules) if EXTERNAL[m] & set(banned)}


def test_the_graph_covers_every_package():
    for pkg in PACKAGES:
        assert pkg in MODULES, f"{pkg} has no __init__.py under {PACKAGES[pkg]}"
    assert "inference_engine.server.grpc_service" in EDGES["inference_engine.server.app"]
    assert "kakeya_wire.v1.runtime_pb2" in MODULES, "generate the stubs first: make proto"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = _cycles(EDGES)
    detail = "\n".join(" <-> ".join(c) for c in cycles)
    assert not cycles, f"import cycles (module-level and function-local imports alike):\n{detail}"


def test_session_layer_imports_no_framework_and_no_grpc():
    session = [m for m in MODULES if _in(m, "inference_engine.session")]
    assert session
    reach = set().union(*(_closure(m) for m in session))
    assert not _where(reach, (*FRAMEWORKS, "grpc")), "the session layer (and what it imports) must stay plain Python"


def test_backends_import_no_grpc_and_no_session_or_server():
    backends = [m for m in MODULES if _in(m, "inference_engine.backends")]
    assert backends
    assert not _where(set().union(*(_closure(m) for m in backends)), ("grpc", "grpc_tools", "google"))
    for m in backends:
        bad = sorted(t for t in EDGES[m] if _in(t, "inference_engine.session") or _in(t, "inference_engine.server"))
        assert not bad, f"{m} imports {bad}"


def test_engine_and_kv_and_proposer_import_no_grpc_or_server():
    for layer in ("inference_engine.engine", "inference_engine.kv", "kv_cache_proposer", "kakeya_research"):
        modules = [m for m in MODULES if _in(m, layer)]
        assert not _where(modules, ("grpc",)), f"{layer} imports grpc"
        for m in modules:
            bad = sorted(t for t in EDGES[m] if _in(t, "inference_engine.server") or _in(t, "kakeya_wire"))
            assert not bad, f"{m} imports {bad}"


# Research code: the research strategies (kakeya_research), the proposers of dlm_restore (same-model and the
# drafter's f_θ) and the training code (not in the runtime wheel: pyproject.toml).
RESEARCH = ("kakeya_research", "kv_cache_proposer.restore", "kv_cache_proposer.same_model", "kv_cache_proposer.training")
# The one way in: the strategy registry asks the research package for its strategies (kakeya_research.kv_strategies).
REGISTRY_HOOK = ("inference_engine.kv.registry", "kakeya_research")


def test_the_product_imports_no_research_code():
    """The product (engine, kv, backends, server, session, persistence, model store) reaches research code only
    through the strategy registry: a research strategy plugs in through the registry, the cache protocol and the
    layout's extra keys, so no product module names it (or its proposers, or the training code)."""
    product = [m for m in MODULES if _in(m, "inference_engine")]
    assert "inference_engine.engine.steps" in product and "inference_engine.backends.torch.attention" in product
    assert REGISTRY_HOOK[1] in EDGES[REGISTRY_HOOK[0]], "the registry finds the research strategies"
    for m in product:
        bad = sorted(t for t in EDGES[m] if any(_in(t, r) for r in RESEARCH) and (m, t) != REGISTRY_HOOK)
        assert not bad, f"{m} imports {bad}: research code plugs in through inference_engine/kv/registry.py"


def test_the_proposer_layer_imports_no_engine():
    """Drafters, proposers and their training take the verifier's pieces as arguments (backends/protocol.py):
    nothing of inference_engine or the research strategies is imported from below."""
    for m in (m for m in MODULES if _in(m, "kv_cache_proposer")):
        bad = sorted(t for t in EDGES[m] if _in(t, "inference_engine") or _in(t, "kakeya_research"))
        assert not bad, f"{m} imports {bad}"


def test_the_runtime_imports_no_training_code():
    """kv_cache_proposer.training is left out of the runtime wheel (pyproject.toml): nothing else imports it."""
    training = "kv_cache_proposer.training"
    for m in (m for m in MODULES if not _in(m, training)):
        bad = sorted(t for t in EDGES[m] if _in(t, training))
        assert not bad, f"{m} imports {bad}, which the runtime wheel does not ship"


def test_finding_the_research_strategies_loads_no_framework():
    """`kakeya serve --help` lists every strategy and research option without loading torch."""
    code = ("import json, sys\n"
            "from inference_engine.kv import registry\n"
            "assert 'dlm_restore' in registry.names() and registry.research_options()\n"
            "print(json.dumps(sorted({k.split('.')[0] for k in sys.modules})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = set(json.loads(r.stdout.strip().splitlines()[-1]))
    assert "kakeya_research" in loaded and not loaded & set(FRAMEWORKS), sorted(loaded & set(FRAMEWORKS))


def test_sdk_and_stubs_import_no_engine():
    for pkg in ("kakeya", "kakeya_wire"):
        for m in (m for m in MODULES if _in(m, pkg)):
            bad = sorted(t for t in _closure(m) if _in(t, "inference_engine") or _in(t, "kv_cache_proposer"))
            assert not bad, f"{m} reaches {bad}: the SDK and the stubs are their own distributions"
            assert "torch" not in EXTERNAL[m], f"{m} imports torch"
    for m in (m for m in MODULES if _in(m, "kakeya_wire")):
        assert not {t for t in EDGES[m] if not _in(t, "kakeya_wire")}, f"{m} imports our code: stubs import only protobuf/grpc"


def test_the_daemon_imports_no_sdk():
    """The daemon and the SDK share only kakeya_wire (stubs, model paths, text rules). `kakeya chat` is
    the SDK's kakeya-chat script, run by exec (inference_engine/server/chat_command.py), not imported."""
    for pkg in ("inference_engine", "kv_cache_proposer"):
        for m in (m for m in MODULES if _in(m, pkg)):
            bad = sorted(t for t in EDGES[m] if _in(t, "kakeya"))
            assert not bad, f"{m} imports {bad}: the daemon does not import its client; shared rules go in kakeya_wire"


def test_the_shared_rules_are_standard_library_only():
    """kakeya_wire's hand-written modules load nothing beyond the standard library (both sides can afford them)."""
    hand_written = [m for m in MODULES if _in(m, "kakeya_wire") and not _in(m, "kakeya_wire.v1")]
    assert "kakeya_wire.local_models" in hand_written and "kakeya_wire.text" in hand_written
    for m in hand_written:
        assert not EXTERNAL[m] - set(sys.stdlib_module_names) - {"__future__"}, f"{m} imports {sorted(EXTERNAL[m])}"


def _loaded_after_import(*modules: str) -> set[str]:
    """Top-level packages in sys.modules after importing `modules` in a fresh interpreter."""
    code = ("import importlib, json, sys\n"
            f"for m in {list(modules)!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted({k.split('.')[0] for k in sys.modules})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("modules, banned", [
    # The servicer and the runtime facade convert plain objects; torch arrives with the engine only.
    (("inference_engine.server.grpc_service", "inference_engine.server.runtime", "inference_engine.server.app",
      "inference_engine.server.cli"), FRAMEWORKS),
    (("inference_engine.session.store", "inference_engine.engine.requests", "inference_engine.engine.events"), (*FRAMEWORKS, "grpc")),
    (("kakeya", "kakeya.client", "kakeya.aio", "kakeya.types", "kakeya.errors"), (*FRAMEWORKS, "inference_engine")),
], ids=["server", "session", "sdk"])
def test_layers_load_no_framework_at_import(modules, banned):
    loaded = _loaded_after_import(*modules)
    assert not loaded & set(banned), f"importing {modules} loads {sorted(loaded & set(banned))}"
