"""Issue "One architecture step": no import cycle between the project's modules, counting the imports
inside functions too (they hid three cycles), and the layering the README describes."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("billingctl", "webhooks_app", "jobs")


def _modules() -> dict[str, Path]:
    mods = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {name: set() for name in mods}

    def owner(target: str) -> str | None:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        return target or None

    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):  # every import, at module level or in a function
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                # `from pkg import module` depends on that module, not on the package's __init__
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                found = owner(target)
                if found and found != name:
                    graph[name].add(found)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_even_through_imports_inside_functions():
    assert _cycles(_graph()) == []


def test_the_finder_sees_a_cycle_hidden_in_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_the_layers_point_one_way():
    """The domain is pure; services never reach the doors (the CLI, the web apps, the job runner; the
    schedule table is data they may read); the container never imports the web layer (the sandbox's
    in-process receiver is provided to it)."""
    graph = _graph()
    for name, targets in graph.items():
        if name.startswith("billingctl.domain"):
            assert all(t.startswith("billingctl.domain") for t in targets), (name, targets)
        if name.startswith("billingctl.services"):
            doors = [t for t in targets if t.startswith(("billingctl.cli", "webhooks_app", "jobs"))
                     and t != "jobs.schedule"]
            assert not doors, (name, doors)
    assert not any(t.startswith("webhooks_app") for t in graph["billingctl.bootstrap"])


def test_services_reach_the_database_only_through_the_repositories():
    """Issue "One architecture step": the SQL lives in the repositories of adapters/db (reached as
    `uow.purchases`, `uow.orphans`, …). No service, web module, job or CLI command imports the table
    definitions, the SQL helpers or SQLAlchemy's query builder."""
    graph = _graph()
    sql = ("billingctl.adapters.db.tables", "billingctl.adapters.db.sql")
    for name, targets in graph.items():
        if name.startswith(("billingctl.services", "webhooks_app", "jobs", "billingctl.cli")):
            assert not [t for t in targets if t in sql], (name, targets)
    for package in ("billingctl/services", "webhooks_app", "jobs", "billingctl/cli"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
                    # webhooks_app/errors.py maps the driver's exceptions to statuses: no query is built there.
                    assert path.name == "errors.py" and node.module == "sqlalchemy", (str(path), node.module)


def test_the_sandboxs_two_vendors_share_no_method_name():
    """Decision 255: `Sandbox` is the provider's model and the orchestrator's together; a method both
    defined would be the provider's alone (the first base wins), silently."""
    from billingctl.sandbox.base import SandboxBase
    from billingctl.sandbox.orchestrator import OrchestratorModel
    from billingctl.sandbox.provider import ProviderModel

    def own(cls: type) -> set[str]:
        return {name for name in vars(cls) if not name.startswith("__")}

    assert own(ProviderModel) and own(OrchestratorModel)
    assert own(ProviderModel) & own(OrchestratorModel) == set()
    assert (own(ProviderModel) | own(OrchestratorModel)) & own(SandboxBase) == set()
