"""The layers docs/architecture.md draws, checked on every module's imports (lazy ones too):

    runtime < core < policies, traces < simulator, proxy < workers < dashboards < benches < cli

A module may import its own layer and the layers below it; product code never imports a bench
or the CLI; the proxy imports neither the simulator nor the workers; and no import circle, at
module level or inside a function, joins any two modules.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("router", "policies", "simulator", "traces", "workers", "dashboards")

BELOW = {
    "runtime": set(),
    "core": {"runtime"},
    "policies": {"core", "runtime"},
    "traces": {"core", "runtime"},
    "simulator": {"core", "runtime", "policies", "traces"},
    "proxy": {"core", "runtime", "policies", "traces"},
    "workers": {"core", "runtime", "policies", "traces", "simulator", "proxy"},
    "dashboards": {"core", "runtime", "policies", "traces", "simulator"},
}
BELOW["bench"] = set(BELOW) | {"bench"}
BELOW["cli"] = BELOW["bench"] | {"cli"}


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[:2] == ["router", "cli"]:
        return "cli"
    if "bench" in parts:
        return "bench"
    if parts[:2] in (["router", "proxy"], ["router", "runtime"]):
        return parts[1] if parts[1] == "runtime" else "proxy"
    return "core" if parts[0] == "router" else parts[0]


@cache
def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


@cache
def imports(module: str) -> frozenset[str]:
    """The project modules `module` imports anywhere in its body."""
    known, out = modules(), set()
    for node in ast.walk(ast.parse(known[module].read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [n if n in known else node.module for n in names]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] in PACKAGES)
    return frozenset(out)


def test_the_layering_covers_every_module() -> None:
    assert {layer(m) for m in modules()} <= set(BELOW)
    assert len(modules()) > 80, "the module scan found too little"


@pytest.mark.parametrize("module", sorted(modules()))
def test_imports_point_down(module: str) -> None:
    own = layer(module)
    allowed = BELOW[own] | {own}
    bad = sorted(n for n in imports(module) if layer(n) not in allowed)
    assert not bad, f"{module} ({own}) imports above its layer: {bad}"


def test_the_proxy_imports_neither_simulator_nor_workers() -> None:
    proxy = [m for m in modules() if layer(m) == "proxy"]
    assert "router.proxy.app" in proxy
    bad = {
        m: sorted(n for n in imports(m) if n.startswith(("simulator", "workers"))) for m in proxy
    }
    assert not {m: b for m, b in bad.items() if b}


def test_no_import_circle() -> None:
    graph = {m: {n for n in imports(m) if n in modules() and n != m} for m in modules()}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if seen.get(n) == 1:
                circle = stack[stack.index(n) :] + [n]
                pytest.fail("import circle: " + " -> ".join(circle))
            if n not in seen:
                visit(n)
        stack.pop()
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m)


def test_a_circle_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The circle check itself: two modules importing each other fail it."""
    fake = {"router.a": frozenset({"router.b"}), "router.b": frozenset({"router.a"})}
    monkeypatch.setitem(globals(), "modules", lambda: dict.fromkeys(fake, ROOT))
    monkeypatch.setitem(globals(), "imports", fake.__getitem__)
    with pytest.raises(pytest.fail.Exception, match="router.a -> router.b -> router.a"):
        test_no_import_circle()
