"""Builders shared by the tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHARED_TRACES = ROOT.parent / "shared" / "traces"


@pytest.fixture
def mooncake_path() -> Path:
    path = SHARED_TRACES / "mooncake" / "conversation_trace.jsonl"
    if not path.exists():
        pytest.skip("../shared/traces is not beside the checkout")
    return path
