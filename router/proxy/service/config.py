"""cluster.yaml: the fleet's config schema, validated on load; an error names the field
(`workers.count: ...`). docs/operations.md documents every field.

Secrets (an API key, the admin token, the client salt) can stay out of the file: each may be
given as `<field>`, `<field>_env` (an environment variable) or `<field>_file` (a file), exactly
one of them, read on load. The config then holds them as SecretStr: a repr, a log line or a
dump shows `**********`; only `with_secrets()` (a replica's stdin) has them in clear.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    SecretStr,
    SerializationInfo,
    ValidationInfo,
    field_validator,
    model_validator,
)

import policies
from router.classes import ClassTable, TrafficClass
from router.config_errors import FieldError, validated
from router.cost_model import GPUS, MODELS, FittedCost
from router.proxy.settings import (
    BODY_TIMEOUT,
    HEADER_TIMEOUT,
    MAX_BODY_BYTES,
    MAX_CLIENT_ID,
    MAX_PRIORITY,
    MAX_WEIGHT,
    MIN_PRIORITY,
    MIN_WEIGHT,
    RESPONSES_MAX_BYTES,
    RESPONSES_RETENTION,
)
from router.traits import IndexMode, Role


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

_REVEAL = {"secrets": "in clear"}  # the dump context that shows secrets (`with_secrets`)


def _reveal(value: SecretStr, info: SerializationInfo) -> str:
    return value.get_secret_value() if info.context == _REVEAL else str(value)


Secret = Annotated[SecretStr, PlainSerializer(_reveal, return_type=str, when_used="json")]


def _secret_forms(data: object, name: str, required: bool) -> object:
    """Raw config `data` with `name` given as itself, `name`_env or `name`_file (exactly one
    if `required`, else at most one), read into `name`. A variable that is not set, or a file
    that cannot be read, is an error naming the form."""
    if not isinstance(data, dict):
        return data
    forms = [f"{name}{form}" for form in ("", "_env", "_file")]
    given = [f for f in forms if data.get(f) is not None]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)}: give only one of {', '.join(forms)}")
    if not given:
        if required:
            raise ValueError(f"{name}: required (or {name}_env, {name}_file)")
        return data
    out = {k: v for k, v in data.items() if k not in forms[1:]}
    form = given[0]
    source = data[form]
    if form == name:
        return out
    if not isinstance(source, str) or not source:
        raise ValueError(f"{form}: expected a {'variable name' if form == forms[1] else 'path'}")
    if form == forms[1]:
        value = os.environ.get(source)
        if not value:
            raise ValueError(f"{form}: the environment variable {source} is not set or empty")
    else:
        try:
            value = Path(source).expanduser().read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{form}: cannot read {source}: {type(e).__name__}") from None
        if not value:
            raise ValueError(f"{form}: {source} is empty")
    out[name] = value
    return out


class KVConnectorConfig(Strict):
    """How a split fleet's prefill workers hand a prompt's KV to its decode workers
    (router/proxy/split.py): `handshake`, the prefill answer's kv_transfer_params name where
    the decode worker pulls it from (vLLM's NixlConnector); `shared`, the prefill worker
    stores it by prompt where the decode worker finds it (vLLM's ExampleConnector)."""

    shape: Literal["handshake", "shared"] = "handshake"
    name: str | None = Field(
        None,
        min_length=1,
        description="the vLLM connector (workers/kv_connector.py: nixl, example); none: nixl "
        "(handshake), example (shared)",
    )
    extra_config: dict[str, object] = Field(
        default_factory=dict, description="vLLM's kv_connector_extra_config"
    )
    shared_path: str | None = Field(
        None, description="shared: where the KV is stored; none: a folder of the serve's own"
    )

    @property
    def connector(self) -> str:
        if self.name is not None:
            return self.name
        return "nixl" if self.shape == "handshake" else "example"


MAX_WORKERS = 256


class WorkersConfig(Strict):
    backend: Literal["vllm", "emulated"] = "emulated"
    count: int = Field(2, ge=0, le=MAX_WORKERS, description="mixed servers to start")
    prefill: int = Field(0, ge=0, le=MAX_WORKERS, description="prefill servers to start")
    decode: int = Field(0, ge=0, le=MAX_WORKERS, description="decode servers to start")
    urls: list[str] = Field(default_factory=list, description="existing servers: no Ray")
    kv_events: list[str] = Field(default_factory=list, description="their KV-event endpoints")
    roles: list[Role] = Field(
        default_factory=list, description="their roles, in the order of urls; none: mixed"
    )
    kv_connector: KVConnectorConfig | None = Field(
        None, description="with prefill and decode workers: how the KV moves between them"
    )
    emulated_topology: str = Field(
        "dgx-h100", description="the network the emulated servers' KV transfers are timed on"
    )
    ray_address: str | None = None
    gpus_per_worker: float = Field(0.0, ge=0)
    first_port: int = Field(8100, ge=1024, le=65000)
    vllm_python: str | None = None
    vllm_args: list[str] = Field(default_factory=list)
    kv_cache_bytes: int = Field(256 * 1024 * 1024, gt=0)
    emulated_preset: ModelPreset = "llama-3-8b"
    emulated_gpu: GPUPreset = "a100-80g"
    emulated_speed: float = Field(1.0, gt=0)
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="the servers' --scheduling-policy; priority: requests carry theirs"
    )

    @model_validator(mode="before")
    @classmethod
    def _no_mixed_beside_roles(cls, data: object) -> object:
        """Prefill and decode counts given alone describe the whole fleet: no mixed servers
        besides (`count` still adds them when given)."""
        if (
            isinstance(data, dict)
            and "count" not in data
            and (data.get("prefill") or data.get("decode"))
        ):
            return {**data, "count": 0}
        return data

    @model_validator(mode="after")
    def _roles(self) -> WorkersConfig:
        if self.urls:
            for name in ("prefill", "decode"):
                if getattr(self, name):
                    raise FieldError(name, "servers to start, not with urls (give roles)")
            if self.roles and len(self.roles) != len(self.urls):
                raise FieldError(
                    "roles", f"one per url: {len(self.urls)} urls, {len(self.roles)} roles"
                )
        elif self.roles:
            raise FieldError("roles", "the roles of urls; servers to start: prefill and decode")
        elif self.num_servers == 0:
            raise FieldError("count", "no servers to start (count, prefill and decode are all 0)")
        elif self.num_servers > MAX_WORKERS:
            raise FieldError("count", f"{self.num_servers} servers in all, at most {MAX_WORKERS}")
        roles = self.server_roles
        num_prefill, num_decode = roles.count(Role.PREFILL), roles.count(Role.DECODE)
        if num_prefill and not num_decode:
            raise FieldError(
                "roles" if self.urls else "decode",
                "prefill workers need decode workers to hand their requests to",
            )
        if num_decode and not num_prefill:
            raise FieldError(
                "roles" if self.urls else "prefill",
                "decode workers need prefill workers to take requests from",
            )
        if self.kv_connector is not None and not num_prefill:
            raise FieldError("kv_connector", "only for a fleet of prefill and decode workers")
        return self

    @property
    def server_roles(self) -> list[Role]:
        """Each server's role, in order: `roles` for urls; else the mixed servers, then the
        prefill ones, then the decode ones (their ports follow first_port in that order)."""
        if self.urls:
            return list(self.roles) or [Role.MIXED] * len(self.urls)
        return (
            [Role.MIXED] * self.count + [Role.PREFILL] * self.prefill + [Role.DECODE] * self.decode
        )

    @property
    def num_servers(self) -> int:
        """Servers to start (none with urls)."""
        return 0 if self.urls else self.count + self.prefill + self.decode

    @property
    def is_split(self) -> bool:
        return any(r is not Role.MIXED for r in self.server_roles)

    @property
    def connector(self) -> KVConnectorConfig:
        """The KV connector (the default one when a split fleet names none)."""
        return self.kv_connector or KVConnectorConfig()


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
    header: float = Field(
        HEADER_TIMEOUT, gt=0, description="for a request's head, from its first byte (408)"
    )


ClientName = Annotated[str, Field(min_length=1, max_length=MAX_CLIENT_ID)]


class LimitsConfig(Strict):
    max_body_bytes: int = Field(MAX_BODY_BYTES, ge=1024, description="larger bodies get a 413")
    max_connections: int | None = Field(
        None,
        ge=1,
        description="open client connections per listener, past it a 503; none: 4096, or "
        "fewer if the open-files limit is low",
    )
    client_labels: Annotated[int, Field(ge=0)] | list[ClientName] = Field(
        20,
        description="metric series besides the tenants': these clients by name, or that many "
        "clients under a pseudonym each, first come; the rest are `other`",
    )


class RedisTLSConfig(Strict):
    """TLS to the replicas' store (a rediss:// redis_url): the CA to verify it by, and this
    client's own certificate and key where the store asks for one."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @field_validator("ca_file", "cert_file", "key_file")
    @classmethod
    def _readable(cls, v: str | None) -> str | None:
        if v is not None and not os.access(Path(v).expanduser(), os.R_OK):
            raise ValueError(f"cannot read {v}")
        return v


PositiveRate = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Priority = Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY, strict=True)]


class RateLimitConfig(Strict):
    """A tenant's budget: token buckets that refill at these rates (router/budgets.py); a
    field left out is unlimited."""

    requests_per_s: PositiveRate | None = None
    burst: Annotated[float, Field(ge=1, allow_inf_nan=False)] | None = Field(
        None, description="requests at once; none: max(1, requests_per_s)"
    )
    input_tokens_per_min: PositiveRate | None = None
    output_tokens_per_min: PositiveRate | None = None

    @model_validator(mode="after")
    def _burst_of_requests(self) -> RateLimitConfig:
        if self.burst is not None and self.requests_per_s is None:
            raise ValueError("burst: needs requests_per_s")
        return self


class TenantConfig(Strict):
    """An API key (`api_key`, `api_key_env` or `api_key_file`), and the client (tenant), the
    weight and the budget it stands for."""

    api_key: Secret
    client: str = Field(min_length=1, max_length=MAX_CLIENT_ID)
    weight: float = Field(1.0, ge=MIN_WEIGHT, le=MAX_WEIGHT)
    rate_limit: RateLimitConfig | None = None
    priority: Priority = Field(0, description="its requests' band (lower first, as vLLM)")

    @model_validator(mode="before")
    @classmethod
    def _key_forms(cls, data: object) -> object:
        return _secret_forms(data, "api_key", required=True)

    @field_validator("api_key")
    @classmethod
    def _long_enough(cls, v: SecretStr) -> SecretStr:
        if len(v.get_secret_value()) < 8:
            raise ValueError("an API key needs at least 8 characters")
        return v


ServedName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\s]+$")]
# A class's name is a metric label: the operator's word, kept short and plain.
ClassName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class ClassConfig(Strict):
    """A traffic class (router/classes.py): the priority its requests carry, its latency
    targets and how long they may wait in a router queue (None: no target, no limit)."""

    priority: Priority
    ttft: Seconds | None = Field(None, description="target time to first token")
    tpot: Seconds | None = Field(None, description="target time per output token")
    max_queue_time: Seconds | None = Field(
        None, description="with admission_control: refused (503) past this in a router queue"
    )


class ResponsesConfig(Strict):
    """The Responses API's stored responses (router/proxy/conversations.py): each can be
    read (GET /v1/responses/{id}) or continued (previous_response_id) for `retention` s."""

    retention: Seconds = Field(
        RESPONSES_RETENTION, description="seconds a stored response can be read or continued"
    )
    max_bytes: int = Field(
        RESPONSES_MAX_BYTES,
        gt=0,
        description="one router's in-memory store, oldest out first; replicas keep theirs in "
        "their Redis, which `fairway serve`'s own bounds to this plus 64 MiB",
    )


class AdapterConfig(Strict):
    """A LoRA adapter clients request by `name` (as vLLM serves it), loaded from `path` onto a
    worker of its group when routing places a request for it there."""

    name: ServedName
    path: str

    @field_validator("path")
    @classmethod
    def _exists(cls, v: str) -> str:
        folder = Path(v).expanduser()
        if not (folder / "adapter_config.json").is_file():
            raise ValueError(f"{v}: no adapter_config.json there (a PEFT LoRA adapter folder)")
        return str(folder.resolve())


class ModelGroupConfig(Strict):
    """One base model and the workers serving it (and its adapters)."""

    served_model_name: ServedName
    model: str | None = Field(None, description="model folder; none: build the tiny test model")
    max_model_len: int = Field(4096, gt=0)
    workers: WorkersConfig = Field(default_factory=WorkersConfig)
    adapters: list[AdapterConfig] = Field(default_factory=list)
    adapter_slots: int = Field(
        4, ge=1, le=256, description="adapters a worker holds at once (vLLM's --max-loras)"
    )
    adapter_load_time: float = Field(
        0.5, ge=0, description="seconds a load takes, weighed against queueing when placing"
    )


@dataclass(frozen=True)
class FleetWorker:
    """A worker of the fleet as started: where it answers, its KV events, its model group (in
    a fleet of several), how many adapters it holds at once, and its role and KV connector's
    shape on a split fleet."""

    url: str
    kv_events: str | None = None
    model: str | None = None
    adapter_slots: int = 0
    priority_scheduling: bool = False  # it runs --scheduling-policy priority
    role: str = "mixed"  # router.traits.Role
    kv_shape: str = "handshake"  # KVConnectorConfig.shape


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
    admin_token: Secret | None = Field(None, description="or admin_token_env, admin_token_file")
    admin_host: str = Field("127.0.0.1", description="the admin listener's address")
    admin_port: int | None = Field(
        None, ge=1, le=65535, description="/metrics and /admin/*; none: port+1"
    )
    client_salt: Secret | None = Field(
        None, description="salts client pseudonyms (or client_salt_env, _file); none: random"
    )
    health_interval: float = Field(1.0, gt=0)
    ray_gcs_grace: float = Field(
        60.0, ge=0, le=3600, description="seconds served on, degraded, after Ray's GCS is gone"
    )
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
        False,
        description="honour X-Client-Id / X-Client-Weight / X-Priority (a trusted gateway's)",
    )
    classes: dict[ClassName, ClassConfig] = Field(
        default_factory=dict, description="traffic classes by name: priority bands and targets"
    )
    latency_routing: bool = Field(
        False, description="route a class with a ttft target among workers predicted to meet it"
    )
    admission_control: bool = Field(
        False, description="503 for requests no worker can serve in time, or queued too long"
    )
    event_loop: Literal["uvloop", "asyncio"] = Field(
        "uvloop", description="the proxy's event loop: uvloop (libuv) where installed, or asyncio's"
    )
    rate_limit_store_failure: Literal["open", "closed"] = Field(
        "open", description="tenant budgets while the replicas' store is away: admit, or 503"
    )
    routers: int = Field(1, ge=1, le=64, description="proxy processes sharing `port`")
    router_sync: float = Field(
        0.1, gt=0, le=60, description="seconds between the replicas' syncs through Redis"
    )
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)
    redis_url: str | None = Field(None, description="the replicas' store; none: start one")
    redis_password: Secret | None = Field(
        None, description="the store's password (or redis_password_env, _file), not in the URL"
    )
    redis_tls: RedisTLSConfig | None = Field(None, description="with a rediss:// redis_url")
    replica_ports: list[int] = Field(
        default_factory=list,
        description="each replica's own (admin) port; none: admin_port .. admin_port+N-1",
    )
    models: list[ModelGroupConfig] = Field(
        default_factory=list,
        description="several model groups; instead of model, served_model_name, "
        "max_model_len and workers",
    )

    @model_validator(mode="after")
    def _groups(self) -> ClusterConfig:
        if not self.models:
            return self
        single = {"model", "served_model_name", "max_model_len", "workers"} & self.model_fields_set
        if single:
            raise ValueError(f"models: give {', '.join(sorted(single))} inside each group")
        names: set[str] = set()
        ports: dict[int, int] = {}
        for i, group in enumerate(self.models):
            for name in [group.served_model_name, *(a.name for a in group.adapters)]:
                if name in names:
                    raise ValueError(f"models.{i}: the name {name!r} is served twice")
                names.add(name)
            w = group.workers
            for port in range(w.first_port, w.first_port + w.num_servers):
                if port in ports:
                    raise ValueError(
                        f"models.{i}.workers.first_port: port {port} is models.{ports[port]}'s"
                    )
                ports[port] = i
        return self

    @model_validator(mode="after")
    def _class_priorities(self) -> ClusterConfig:
        seen: dict[int, str] = {}
        for name, c in self.classes.items():
            if c.priority in seen:
                raise ValueError(
                    f"classes.{name}.priority: {c.priority} is {seen[c.priority]}'s too"
                )
            seen[c.priority] = name
        return self

    @property
    def class_table(self) -> ClassTable:
        return ClassTable(TrafficClass(name, **c.model_dump()) for name, c in self.classes.items())

    @property
    def uses_priorities(self) -> bool:
        """Whether a request can carry a priority other than 0: then every worker's router
        queue is in bands."""
        return (
            bool(self.classes)
            or self.trust_client_headers
            or any(t.priority for t in self.tenants)
            or any(g.workers.scheduling_policy == "priority" for g in self.groups)
        )

    @property
    def groups(self) -> list[ModelGroupConfig]:
        """The model groups: `models`, or the one the single-model fields describe."""
        if self.models:
            return list(self.models)
        return [
            ModelGroupConfig(
                served_model_name=self.served_model_name,
                model=self.model,
                max_model_len=self.max_model_len,
                workers=self.workers,
            )
        ]

    @model_validator(mode="before")
    @classmethod
    def _secrets(cls, data: object) -> object:
        for name in ("admin_token", "client_salt", "redis_password"):
            data = _secret_forms(data, name, required=False)
        return data

    @model_validator(mode="after")
    def _admin_ports(self) -> ClusterConfig:
        if self.admin_port is not None and self.replica_ports:
            raise ValueError("admin_port and replica_ports: give one (each replica's port)")
        if self.port in self.admin_ports or max(self.admin_ports) > 65535:
            raise ValueError(
                f"admin_port: the admin listeners {self.admin_ports} need ports of their own, "
                f"not `port` ({self.port}), at most 65535"
            )
        return self

    @property
    def admin_ports(self) -> list[int]:
        """Each router's admin listener (/metrics, /admin/*): `replica_ports`, else
        `admin_port` (default port+1) and the ports after it."""
        if self.replica_ports:
            return list(self.replica_ports)
        first = self.admin_port or self.port + 1
        return [first + i for i in range(self.routers)]

    def with_salt(self) -> ClusterConfig:
        """This config with a client salt: its own, else a new random one. `fairway serve`
        draws it once, so that its replicas name every client alike."""
        if self.client_salt is not None:
            return self
        return self.model_copy(update={"client_salt": SecretStr(secrets.token_hex(16))})

    def with_secrets(self) -> dict:
        """The config as JSON data with its secrets in clear: for a replica's stdin, never a
        log (`model_dump` shows them as `**********`)."""
        return self.model_dump(mode="json", context=_REVEAL)

    @field_validator("redis_url")
    @classmethod
    def _redis(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("expected a redis://, rediss:// or unix:// URL")
        if "@" in v.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError(
                "a password in the URL would be logged with it: give it as redis_password "
                "(or redis_password_env, redis_password_file)"
            )
        return v

    @model_validator(mode="after")
    def _redis_tls(self) -> ClusterConfig:
        if self.redis_tls is not None and not (self.redis_url or "").startswith("rediss://"):
            raise ValueError("redis_tls: needs a rediss:// redis_url")
        return self

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
        keys = [t.api_key.get_secret_value() for t in v]
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
    return validated(ClusterConfig, raw, source)
