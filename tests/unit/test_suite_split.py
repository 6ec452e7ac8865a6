"""How `make test` splits the suite between its two workers (tests/conftest.py)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import VLLM_TESTS, work_unit

TESTS = Path(__file__).resolve().parents[1]
# What a module that starts vLLM names: a fleet of vLLM workers, the shared pair, vLLM's venv.
STARTS_VLLM = re.compile(r'"backend": "vllm"|vllm_pair|VLLM_PYTHON')


def test_every_module_that_starts_vllm_runs_in_the_vllm_unit() -> None:
    for folder in ("system", "live"):
        for path in sorted((TESTS / folder).glob("test_*.py")):
            if STARTS_VLLM.search(path.read_text()):
                name = path.relative_to(TESTS.parent).as_posix()
                assert any(t.startswith(name) for t in VLLM_TESTS), f"{name}: add to VLLM_TESTS"


def test_units() -> None:
    assert work_unit("tests/system/test_vllm_live.py::test_a[x]") == "vllm"
    assert work_unit(VLLM_TESTS[-1]) == "vllm"
    chaos = "tests/system/test_chaos.py"
    assert work_unit(f"{chaos}::test_one") == work_unit(f"{chaos}::test_two") == chaos
    other = "tests/live/test_split_proxy.py::test_something_else"
    assert work_unit(other) == other
    assert work_unit("tests/sim/test_engine.py::test_x") == "tests/sim/test_engine.py::test_x"
