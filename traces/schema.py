"""Fairway's native trace: JSON Lines, one request a line, after an optional header line.

    {"fairway_trace": 1, "block_size": 16, "keyed": true}
    {"arrival": 0.0, "prompt_len": 812, "output_len": 64, "block_hashes": [...], "client": "a"}
    {"arrival": 0.4, "prompt_len": 95, "output_len": 12, "session": "s1", "think_time": 2.0}
    {"arrival": 0.5, "prompt_len": 95, "output_len": 12, "model": "8b", "adapter": "sql"}
    {"arrival": 0.6, "prompt_len": 4096, "output_len": 80, "session": "a1", "api": "responses"}

`arrival` is in seconds. `block_hashes` are the chained hashes of the prompt's full blocks of
`block_size` tokens (router.request.hash_token_blocks). `model` (the model group), `adapter`
(a LoRA adapter) and `cache_salt` are part of a block's identity: a header that says `keyed`
promises the hashes already include them (as `write_native` writes them); otherwise each
request's hashes are re-keyed under its identity on reading (`router.request.rekey_blocks`), so
a trace of plain token hashes, such as a converted public one, needs no hashing of its own.
`api` names the client API that sent a request (completions, chat, responses, messages); a
trace that does not say leaves it unknown.
Every loader returns a `Trace`; every error names the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router.request import (
    BLOCK_HASH_END,
    BLOCK_HASH_MIN,
    Api,
    Request,
    cache_root,
    rekey_blocks,
)
from traces.tiled import TiledRequests

DEFAULT_BLOCK_SIZE = 16


class TraceError(ValueError):
    """A trace that cannot be read; the message starts with `file:line:`."""

    def __init__(self, path: str | Path, line: int | None, message: str) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")
        self.path, self.line = str(path), line


@dataclass(slots=True)
class Trace:
    # A list, or a tiled trace's copies made as they are read (traces.tiled.TiledRequests).
    requests: Sequence[Request]
    block_size: int = DEFAULT_BLOCK_SIZE
    source: str = ""
    meta: dict[str, object] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration(self) -> float:
        return self.requests[-1].arrival - self.requests[0].arrival if self.requests else 0.0

    @property
    def clients(self) -> list[str]:
        return sorted(set(self.column("client")))

    def column(self, name: str) -> list[Any]:
        """Every request's field `name`, in order (a tiled trace's without making its copies)."""
        if isinstance(self.requests, TiledRequests):
            return self.requests.column(name)
        return [getattr(r, name) for r in self.requests]


class TraceHeader(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fairway_trace: int = Field(1, ge=1, le=1)
    block_size: int = Field(DEFAULT_BLOCK_SIZE, gt=0)
    keyed: bool = False  # block_hashes already carry each request's cache identity
    # A split fleet's recording: each worker's role by id (mixed, prefill, decode), so that a
    # replay runs the same pools.
    roles: list[Literal["mixed", "prefill", "decode"]] | None = None


class TraceLine(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: int | None = None
    arrival: float = Field(ge=0)
    prompt_len: int = Field(gt=0)
    output_len: int = Field(gt=0)
    block_hashes: list[Annotated[int, Field(ge=BLOCK_HASH_MIN, lt=BLOCK_HASH_END)]] = Field(
        default_factory=list
    )
    client: str = "default"
    session: str | None = None
    priority: int = 0
    weight: float = Field(1.0, gt=0)
    think_time: float | None = Field(None, ge=0)
    model: str | None = Field(None, min_length=1)
    adapter: str | None = Field(None, min_length=1)
    cache_salt: str | None = Field(None, min_length=1)  # vLLM refuses an empty salt too
    api: Api | None = None  # the client API that sent it
    # A proxy's recording (router/proxy/capture.py) also says who served each request; a replay
    # ignores it, a comparison of routing decisions reads it from Trace.meta["served_by"].
    worker: int | None = None
    decode_worker: int | None = None  # a split request's (`worker`, the policy's, prefilled it)
    policy: str | None = None


def first_error(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    return f"field {loc!r}: {e['msg']}" if loc else e["msg"]


def json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a line that is not a JSON object raises."""
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise TraceError(path, lineno, f"not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(path, lineno, "expected a JSON object")
            yield lineno, obj


def load_native(path: Path) -> Trace:
    return finish(read_native(path))


def read_native(path: Path) -> Trace:
    """A native trace as written: not yet sorted, rebased or checked (see `finish`)."""
    block_size, keyed, roles = DEFAULT_BLOCK_SIZE, False, None
    requests: list[Request] = []
    served_by: dict[int, int] = {}
    policies: set[str] = set()
    for lineno, obj in json_lines(path):
        try:
            if "fairway_trace" in obj:
                if requests:
                    raise TraceError(path, lineno, "the header must be the first line")
                header = TraceHeader.model_validate(obj)
                block_size, keyed, roles = header.block_size, header.keyed, header.roles
                continue
            line = TraceLine.model_validate(obj)
        except ValidationError as e:
            raise TraceError(path, lineno, first_error(e)) from None
        fields = line.model_dump()
        worker, policy = fields.pop("worker"), fields.pop("policy")
        fields.pop("decode_worker")  # who served it, as `worker`: not the request's to replay
        fields["id"] = len(requests) if line.id is None else line.id
        root = None if keyed else cache_root(line.model, line.adapter, line.cache_salt)
        if root is not None:
            fields["block_hashes"] = rekey_blocks(line.block_hashes, root)
        requests.append(Request(**fields))
        if worker is not None:
            served_by[fields["id"]] = worker
        if policy is not None:
            policies.add(policy)
    if not requests:
        raise TraceError(path, None, "no requests in trace")
    meta: dict[str, object] = {}
    if served_by:
        meta["served_by"] = served_by
        meta["policy"] = ",".join(sorted(policies))
    if roles is not None:
        meta["roles"] = list(roles)
    return Trace(requests, block_size, source=str(path), meta=meta)


# Written only where they differ from their default.
OPTIONAL_FIELDS = (
    ("session", None),
    ("priority", 0),
    ("weight", 1.0),
    ("model", None),
    ("adapter", None),
    ("cache_salt", None),
    ("api", None),
)


def write_native(trace: Trace, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        # A Request's block_hashes include its cache identity already: written as keyed.
        header = {"fairway_trace": 1, "block_size": trace.block_size, "keyed": True}
        f.write(json.dumps(header) + "\n")
        for r in trace.requests:
            line = {
                "id": r.id,
                "arrival": round(r.arrival, 6),
                "prompt_len": r.prompt_len,
                "output_len": r.output_len,
                "block_hashes": r.block_hashes,
                "client": r.client,
            }
            for key, default in OPTIONAL_FIELDS:
                if getattr(r, key) != default:
                    line[key] = getattr(r, key)
            if r.think_time is not None:
                line["think_time"] = r.think_time
            f.write(json.dumps(line) + "\n")


def finish(trace: Trace) -> Trace:
    """Sort by arrival (stable), rebase time to start at 0 and check ids are unique."""
    reqs = sorted(trace.requests, key=lambda r: r.arrival)
    if reqs and reqs[0].arrival != 0:
        t0 = reqs[0].arrival
        for r in reqs:
            r.arrival -= t0
    seen: set[int] = set()
    for r in reqs:
        if r.id in seen:
            raise TraceError(trace.source, None, f"request id {r.id} appears twice")
        seen.add(r.id)
    trace.requests = reqs
    return trace


def renumber(requests: Iterable[Request]) -> list[Request]:
    out = list(requests)
    for i, r in enumerate(out):
        r.id = i
    return out
