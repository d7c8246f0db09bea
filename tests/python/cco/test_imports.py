"""The package structure, read from the source's imports (nothing is imported or run).

Guards the layout README.md describes: dependencies point one way (the runtime uses the kernels;
the kernels use only the pure contracts of ``cco``), the kernel folders do not reach into each
other, benchmark tooling stays out of the runtime, and no module imports itself through a circle.
Every import counts, also one inside a function or under ``TYPE_CHECKING``: a lazy import is still
a dependency. Before the packages were split by concern, ``kernels_fused.gemm_gfx950`` and
``kernels_fused.gfx950_backend`` imported each other and the kernels imported ``cco.backends``;
``test_no_import_circle`` and ``test_kernels_use_only_the_pure_contracts`` fail on that tree.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.host

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("cco", "kernels_fused")
# the pure contracts: arithmetic and formats that import no runtime, device or communicator
CONTRACTS = {"cco.layout", "cco.quant", "cco.preshuffle", "cco.validate"}
KERNEL_TARGETS = ("kernels_fused.gfx950", "kernels_fused.hopper", "kernels_fused.cpu")
TOOLS = ("cco.bench", "cco.demo")  # measurement and the main job: users of the runtime, never used by it


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules ``name`` imports anywhere in its source (``from a import b`` names module
    ``a.b`` when that is a module, else ``a``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a package path: the module it names
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = project_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(start):
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def offending(graph, source_prefix: str, allowed) -> list[str]:
    return [f"{src} -> {dst}" for src, dsts in sorted(graph.items()) if within(src, source_prefix)
            for dst in sorted(dsts) if not allowed(dst)]


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_walk_sees_the_packages(graph):
    """The walk reads real imports (a walk that found nothing would pass every rule below)."""
    assert {"cco.op", "cco.backends.cuda", "kernels_fused.pipeline.schedule", "kernels_fused.gfx950.kernel",
            "kernels_fused.hopper.gemm", "kernels_fused.cpu.tiles", "cco.bench.timing"} <= set(graph)
    assert "cco.backends.cuda" in graph["cco.op"] or "cco.backends.cpu" in graph["cco.op"]
    assert "kernels_fused.pipeline.schedule" in graph["kernels_fused.gfx950.kernel"]
    assert "kernels_fused.hopper.gemm" in graph["cco.backends.cuda"]


def test_no_import_circle(graph):
    assert circles(graph) == []


def test_circles_are_found():
    """The circle finder itself: a two-module loop and a three-module loop behind a tail."""
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert circles({"t": {"x"}, "x": {"y"}, "y": {"z"}, "z": {"x"}}) == [["x", "y", "z"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_kernels_use_only_the_pure_contracts(graph):
    bad = offending(graph, "kernels_fused", lambda dst: within(dst, "kernels_fused") or dst in CONTRACTS)
    assert bad == [], "a kernel module imports the runtime:\n" + "\n".join(bad)


def test_contracts_import_only_contracts(graph):
    for contract in sorted(CONTRACTS):
        assert graph[contract] <= CONTRACTS, f"{contract} imports {sorted(graph[contract] - CONTRACTS)}"


def test_pipeline_walks_no_kernel(graph):
    """The schedule and its checkers stand alone; the gfx950 kernel is emitted from them, not the reverse."""
    bad = offending(graph, "kernels_fused.pipeline",
                    lambda dst: not any(within(dst, t) for t in KERNEL_TARGETS))
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize("target", KERNEL_TARGETS)
def test_kernel_targets_are_independent(graph, target):
    others = [t for t in KERNEL_TARGETS if t != target]
    bad = offending(graph, target, lambda dst: not any(within(dst, o) for o in others))
    assert bad == [], "\n".join(bad)


def test_runtime_never_imports_the_tools(graph):
    runtime = [m for m in graph if within(m, "cco") and not any(within(m, t) for t in TOOLS)]
    bad = [f"{m} -> {d}" for m in sorted(runtime) for d in sorted(graph[m]) if any(within(d, t) for t in TOOLS)]
    assert bad == [], "\n".join(bad)


def test_backends_do_not_import_the_op(graph):
    bad = offending(graph, "cco.backends", lambda dst: dst != "cco.op")
    assert bad == [], "\n".join(bad)


def test_runtime_never_imports_the_layers(graph):
    """``cco.nn`` builds on the runtime (op, communicator, torch.library ops); the runtime, the
    kernels and the tools stay usable without it. Its one user inside the package is
    ``cco.integrations`` (the frameworks' styles that build the layers)."""
    bad = [f"{m} -> {d}" for m in sorted(graph) if not within(m, "cco.nn") and not within(m, "cco.integrations")
           for d in sorted(graph[m]) if within(d, "cco.nn")]
    assert bad == [], "\n".join(bad)


def test_nothing_imports_the_integrations(graph):
    """``cco.integrations`` sits on top (transformers and torch's parallel styles around the layers):
    nothing else in the package imports it, so ``cco`` imports without transformers."""
    assert "cco.integrations.hf" in graph and "cco.nn" in graph["cco.integrations.fused"]
    bad = [f"{m} -> {d}" for m in sorted(graph) if not within(m, "cco.integrations")
           for d in sorted(graph[m]) if within(d, "cco.integrations")]
    assert bad == [], "\n".join(bad)
