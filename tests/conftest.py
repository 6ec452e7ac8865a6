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
