"""The layers DESIGN.md draws: policies see only the core, the core sees neither backend."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = sorted(p for p in (ROOT / "router").glob("*.py") if p.name != "cli.py")


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def project_imports(path: Path) -> set[str]:
    tops = {"router", "policies", "simulator", "traces", "workers", "dashboards"}
    return {n for n in imported(path) if n.split(".")[0] in tops}


@pytest.mark.parametrize("path", sorted((ROOT / "policies").glob("*.py")), ids=lambda p: p.name)
def test_policies_import_only_the_core(path: Path) -> None:
    core = {f"router.{p.stem}" for p in CORE}
    bad = {n for n in project_imports(path) if n not in core and not n.startswith("policies")}
    assert not bad, f"{path.name} reaches across layers: {sorted(bad)}"


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_core_imports_no_backend(path: Path) -> None:
    bad = {n for n in project_imports(path) if not n.startswith("router.") or "proxy" in n}
    assert not bad, f"router/{path.name} imports a backend or the proxy: {sorted(bad)}"
