"""Marks every test in this folder `system` and `slow` (see tests/conftest.py)."""

from pathlib import Path

from tests.helpers import mark_folder


def pytest_collection_modifyitems(items):
    mark_folder(items, Path(__file__).parent, "system", "slow")
