"""Test layers, one folder each, marked by the folder's own conftest:

    unit/    one module or policy driven by hand: no I/O beyond files
    sim/     the simulator end to end, the compiled build, reports
    live/    the proxy over real HTTP against emulated workers, in this process
    system/  whole processes: `fairway serve`, real vLLM, Redis, Prometheus (all `slow`)

`-m "not slow"` starts no process of any kind: a test outside `slow` that tries fails at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHARED_TRACES = ROOT.parent / "shared" / "traces"
# The vLLM servers the tests start share one cache in the checkout, not the user's home.
os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / "build" / "vllm-cache"))


# `make test` runs the suite on two pytest-xdist workers. The tests that start servers run on
# one of them, one after another as without workers: they wait on servers much of the time,
# each vLLM server takes a core of its own, and the session's shared vLLM pair starts once. The
# simulator, unit and in-process proxy tests run on the other worker beside them.
SERVER_TESTS = (
    "tests/system/",
    "tests/live/test_split_proxy.py::test_fairway_serve_fronts_a_split_vllm_fleet",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ServersOnOneWorker(LoadScopeScheduling):
        """Every server test in one unit of work (the largest, so it starts first); any other
        test a unit of its own."""

        def _split_scope(self, nodeid: str) -> str:
            return "servers" if nodeid.startswith(SERVER_TESTS) else nodeid

    return ServersOnOneWorker(config, log)


@pytest.fixture(autouse=True)
def _no_process_unless_slow(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    if request.node.get_closest_marker("slow") is None:

        def refuse(self, args, *a, **k):
            raise AssertionError(f"a test not marked slow started a process: {args!r}")

        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield


@pytest.fixture
def mooncake_path() -> Path:
    path = SHARED_TRACES / "mooncake" / "conversation_trace.jsonl"
    if not path.exists():
        pytest.skip("../shared/traces is not beside the checkout")
    return path
