"""cluster.yaml: the fleet's config schema, validated on load; an error names the field
(`workers.count: ...`). docs/operations.md documents every field."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Literal

import yaml
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
from router.cost_model import GPUS, MODELS, FittedCost
from router.proxy.settings import (
    BODY_TIMEOUT,
    MAX_BODY_BYTES,
    MAX_CLIENT_ID,
    MAX_WEIGHT,
    MIN_WEIGHT,
)
from router.traits import IndexMode


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
    index_mode: IndexMode = IndexMode.APPROXIMATE
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
