"""The shape of the code, checked from the code: the import graph of ``src/onceonly`` has no circle
(imports made only for the type checker aside; lazy imports inside functions count), and no module
reads the ``Ledger``'s private attributes (they go through ``ledger.runtime`` and public names)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT = SRC / "onceonly"


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module(p): p for p in ROOT.rglob("*.py")}
PACKAGES = {m for m, p in MODULES.items() if p.name == "__init__.py"}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                lines.update(n.lineno for n in ast.walk(stmt) if hasattr(n, "lineno"))
    return lines


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules of ``src/onceonly`` an import statement in ``module`` loads."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = module if module in PACKAGES else module.rpartition(".")[0]
        if node.level:
            parts = base.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1])
            target = f"{base}.{node.module}" if node.module else base
        else:
            target = node.module or ""
        names = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names]
    found = []
    for name in names:
        loaded = name
        while loaded and loaded not in MODULES:  # an attribute of a module: the module
            loaded = loaded.rpartition(".")[0]
        if loaded and loaded != module:
            found.append(loaded)
    return found


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and node.lineno not in skip:
                edges[module].update(_targets(module, node))
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_imports_of_every_kind() -> None:
    """The checker itself: absolute, relative, lazy and package imports are edges; type-only ones are not."""
    edges = _graph()
    assert "onceonly.drivers" in edges["onceonly.tools"]
    assert "onceonly.runtime" in edges["onceonly.drivers"]
    assert "onceonly.ledger" not in edges["onceonly.drivers"]  # only under TYPE_CHECKING, if at all
    assert any(m.startswith("onceonly.server.") for m in edges["onceonly.server"])  # a relative import


def test_no_import_circle() -> None:
    """Imports point down the layers (docs/design.md): a module never needs, at run time, one that needs it."""
    circles = _circles(_graph())
    assert circles == [], "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_no_module_reads_the_ledgers_private_attributes() -> None:
    reads = []
    for module, path in MODULES.items():
        if module == "onceonly.ledger":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name | ast.Attribute)
                and (node.value.id if isinstance(node.value, ast.Name) else node.value.attr) == "ledger"
            ):
                reads.append(f"{module}:{node.lineno} ledger.{node.attr}")
    assert reads == [], reads


# The framework integrations: each goes through the edge contract, none through another.
INTEGRATIONS = {
    f"onceonly.{name}"
    for name in (
        "agno", "autogen", "claude_agent_sdk", "crewai", "google_adk", "langchain", "llamaindex",
        "openai_agents", "pydantic_ai", "smolagents",
    )
}  # fmt: skip


def test_integrations_go_through_the_edge_and_never_through_each_other() -> None:
    graph = _graph()
    assert set(graph) >= INTEGRATIONS, INTEGRATIONS - set(graph)
    for name in sorted(INTEGRATIONS):
        assert "onceonly.edge" in graph[name], f"{name} does not import onceonly.edge"
        others = sorted(graph[name] & (INTEGRATIONS - {name}))
        assert not others, f"{name} imports {others}: share through onceonly.edge instead"
