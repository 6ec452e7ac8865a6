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


# `make test` runs the suite on two pytest-xdist workers. The tests that start vLLM run on one
# of them, one after another as without workers: each vLLM server takes a core of its own, a
# start under load takes several times as long, and the session's shared vLLM pair starts once.
# Every other module of tests/system (the proxy, emulated workers, Redis, Prometheus) is a unit
# of its own, its tests on one worker so that its module's servers start once; the simulator,
# unit and in-process proxy tests are units of one test. tests/unit/test_suite_split.py checks
# that every module naming a vLLM backend is listed here.
VLLM_TESTS = (
    "tests/system/test_faults.py",
    "tests/system/test_lora_live.py",
    "tests/system/test_validate.py",
    "tests/system/test_vllm_agents.py",
    "tests/system/test_vllm_drift.py",
    "tests/system/test_vllm_kv_connector.py",
    "tests/system/test_vllm_live.py",
    "tests/system/test_vllm_priority.py",
    "tests/system/test_vllm_profile.py",
    "tests/live/test_split_proxy.py::test_fairway_serve_fronts_a_split_vllm_fleet",
)
SERVER_MODULES = "tests/system/"


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to (see VLLM_TESTS): tests of one unit share a worker."""
    if nodeid.startswith(VLLM_TESTS):
        return "vllm"
    if nodeid.startswith(SERVER_MODULES):
        return nodeid.split("::", 1)[0]
    return nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        """Units as `work_unit` names them, largest first (xdist's order)."""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)


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
