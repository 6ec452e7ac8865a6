"""The layers docs/architecture.md draws, checked on every module's imports (lazy ones too):

    runtime < core < policies, traces < simulator, proxy < workers < dashboards < benches < cli

A module may import its own layer and the layers below it; product code never imports a bench
or the CLI; the proxy (router/proxy/, its benches included) imports neither the simulator nor
the workers; the tests' shared helpers import no bench; and no import circle, at module level
or inside a function, joins any two modules.
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


def is_bench(module: str) -> bool:
    return "bench" in module.split(".")


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[:2] == ["router", "cli"]:
        return "cli"
    if is_bench(module):
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
    return imports_in(modules()[module])


def imports_in(path: Path) -> frozenset[str]:
    """The project modules the file at `path` imports anywhere in its body."""
    known, out = modules(), set()
    for node in ast.walk(ast.parse(path.read_text())):
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
    """Its benches included: one that starts simulators or workers lives in workers/bench/."""
    proxy = [m for m in modules() if m.split(".")[:2] == ["router", "proxy"]]
    assert "router.proxy.app" in proxy
    bad = {
        m: sorted(n for n in imports(m) if n.split(".")[0] in ("simulator", "workers"))
        for m in proxy
    }
    bad = {m: b for m, b in bad.items() if b}
    assert not bad, f"the proxy imports the simulator or the workers: {bad}"


def test_a_proxy_bench_reaching_the_workers_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = {
        "router.proxy.app": frozenset(),
        "router.proxy.bench.fake": frozenset({"workers.emulated.cli"}),
    }
    monkeypatch.setitem(globals(), "modules", lambda: dict.fromkeys(fake, ROOT))
    monkeypatch.setitem(globals(), "imports", fake.__getitem__)
    with pytest.raises(AssertionError, match=r"router\.proxy\.bench\.fake.*workers\.emulated"):
        test_the_proxy_imports_neither_simulator_nor_workers()


def shared_helpers() -> list[Path]:
    """The tests' modules other tests import or pytest loads for them."""
    tests = ROOT / "tests"
    found = [tests / "helpers.py", tests / "live_helpers.py", *sorted(tests.rglob("conftest.py"))]
    assert len(found) > 3 and all(p.is_file() for p in found), "a shared helper went missing"
    return found


def test_the_tests_shared_helpers_import_no_bench() -> None:
    """A benchmark may change what it measures at any time; the helpers most tests stand on
    must not change with it (load generators and the like live beside the product)."""
    bad = {str(p): sorted(filter(is_bench, imports_in(p))) for p in shared_helpers()}
    bad = {p: b for p, b in bad.items() if b}
    assert not bad, f"shared test helpers import benches: {bad}"


def test_a_helper_importing_a_bench_is_caught(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    helper = tmp_path / "conftest.py"
    helper.write_text("def f():\n    from workers.bench.proxy import throughput\n")
    monkeypatch.setitem(globals(), "shared_helpers", lambda: [helper])
    with pytest.raises(AssertionError, match=r"conftest\.py.*workers\.bench\.proxy"):
        test_the_tests_shared_helpers_import_no_bench()


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
