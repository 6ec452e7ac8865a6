"""The emulated server's side of split prefill and decode: vLLM's KV connectors as the proxy
meets them (router/proxy/split.py), with transfer times from the network model.

    prefill role, handshake: a request asking for a remote decode (kv_transfer_params
        do_remote_decode) is answered with kv_transfer_params naming this engine, its blocks,
        host and port, as vLLM's NixlConnector answers;
    prefill role, shared: each answered prompt is stored under its key in the shared folder,
        as vLLM's ExampleConnector stores its KV (a small file: where it was computed);
    decode role: a request whose prompt's KV is elsewhere (do_remote_prefill with the
        handshake's fields, or its key in the shared folder) waits the transfer's time on the
        network (simulator/topology.py: its bytes over the path's bottleneck, plus latency),
        then computes only the prompt's last token; the prompt is reported cached, and counted
        in vLLM's external prefix-cache counters.
    mixed role: no connector; transfer parameters are ignored, as vLLM without one ignores them.

Server i of a fleet is GPU i of the network. The handshake's engine id names the prefill
server's GPU (`emulated-gpu3-...`), which a real decode server would learn from its handshake
with that engine. Transfers run alone on the network: concurrent ones do not share links here.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from router.request import Request
from router.traits import Role
from simulator.topology import Topology, kv_bytes
from workers.kv_connector import transferred_tokens

KV_TRANSFER = "kv_transfer_params"
_ENGINE_GPU = re.compile(r"^emulated-gpu(\d+)-")
# What a decode server needs to pull from its prefill server (vLLM's NIXL checks these).
_HANDSHAKE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


def prompt_key(body: dict) -> str:
    """A prompt's identity across servers: what it asks of which model, under which salt. As
    ExampleConnector's folder names, the same prompt gives the same key on every server."""
    what = {k: body.get(k) for k in ("model", "prompt", "messages", "cache_salt")}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Incoming:
    """A prompt whose KV arrives from elsewhere: the tokens sent and how long they take."""

    tokens: int
    seconds: float
    cached: int  # the tokens reported cached: held here already plus those sent


class Connector:
    """One emulated server's KV connector: its role, its shape (handshake or shared), and
    where it sits on the network."""

    def __init__(
        self,
        role: str = Role.MIXED,
        shape: str = "handshake",
        topology: Topology | None = None,
        gpu: int = 0,
        shared_dir: str | Path | None = None,
        kv_bytes_per_token: int = 0,
        block_size: int = 128,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.role = Role(role)
        if shape not in ("handshake", "shared"):
            raise ValueError(f"KV connector shape {shape!r}: handshake or shared")
        if shape == "shared" and self.role is not Role.MIXED and shared_dir is None:
            raise ValueError("a shared connector needs its shared folder (--kv-shared-dir)")
        if topology is not None and not 0 <= gpu < topology.num_gpus:
            raise ValueError(f"GPU {gpu} is not in the network (0..{topology.num_gpus - 1})")
        self.shape, self.topology, self.gpu = shape, topology, gpu
        self.shared_dir = Path(shared_dir) if shared_dir is not None else None
        self.kv_bytes_per_token, self.block_size = kv_bytes_per_token, block_size
        self.host, self.port = host, port
        self.engine_id = f"emulated-gpu{gpu}-{uuid.uuid4().hex[:12]}"
        # Each request's (max_tokens, kv_transfer_params) as received, newest last: what a
        # proxy sent this server, for tests and for looking into a running fleet.
        self.received: deque[tuple[object, object]] = deque(maxlen=1024)

    def note(self, body: dict) -> None:
        limit = body.get("max_tokens", body.get("max_completion_tokens"))
        if limit is None:  # the Responses API's
            limit = body.get("max_output_tokens")
        self.received.append((limit, body.get(KV_TRANSFER)))

    def incoming(self, body: dict, req: Request, local_hit: int) -> Incoming | None:
        """Where `req`'s prompt KV comes from, for a decode server: None, computed here."""
        if self.role is not Role.DECODE:
            return None
        if self.shape == "handshake":
            params = body.get(KV_TRANSFER)
            if not isinstance(params, dict) or not params.get("do_remote_prefill"):
                return None
            if any(params.get(f) is None for f in _HANDSHAKE_FIELDS):
                return None  # nothing to pull from: vLLM computes such a prompt itself
            source = _ENGINE_GPU.match(str(params["remote_engine_id"]))
            src = int(source.group(1)) if source else None
            tokens = transferred_tokens(req.prompt_len, "nixl", self.block_size, local_hit)
        else:
            assert self.shared_dir is not None
            path = self.shared_dir / f"{prompt_key(body)}.json"
            try:
                src = int(json.loads(path.read_text())["gpu"])
            except (OSError, ValueError, KeyError, TypeError):
                return None
            tokens = transferred_tokens(req.prompt_len, "example", self.block_size, local_hit)
        if tokens <= 0:
            return None
        return Incoming(tokens, self._seconds(src, tokens), local_hit + tokens)

    def _seconds(self, src: int | None, tokens: int) -> float:
        topology = self.topology
        if topology is None or src is None or not 0 <= src < topology.num_gpus:
            return 0.0  # a source off this network: its time is not known here
        return topology.transfer_time(src, self.gpu, kv_bytes(tokens, self.kv_bytes_per_token))

    def answer_params(self, body: dict, req: Request, request_id: str) -> dict | None:
        """kv_transfer_params for a prefill server's answer, when its request asked for a
        remote decode (handshake): where the decode server pulls the prompt's KV from."""
        if self.role is not Role.PREFILL or self.shape != "handshake":
            return None
        params = body.get(KV_TRANSFER)
        if not isinstance(params, dict) or not params.get("do_remote_decode"):
            return None
        num_blocks = -(-req.prompt_len // self.block_size)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(range(num_blocks))],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
            "remote_num_tokens": req.prompt_len,
        }

    def stored(self, body: dict) -> None:
        """A prefill server of the shared shape computed this prompt: it is in the store."""
        if self.role is not Role.PREFILL or self.shape != "shared":
            return
        assert self.shared_dir is not None
        path = self.shared_dir / f"{prompt_key(body)}.json"
        scratch = path.with_suffix(f".{uuid.uuid4().hex[:8]}.tmp")
        scratch.write_text(json.dumps({"gpu": self.gpu}))
        scratch.replace(path)  # whole or not at all, for a decode server reading it now
