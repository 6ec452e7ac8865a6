"""Secrets and identities on `fairway serve`, run as a user runs it (issue 27 A, B, C).

Two proxies in front of one emulated worker: an open one (no tenants), and a keyed one whose
tenant keys and admin token come from an environment variable and files, with a trusted
gateway, run as two replicas when redis-server is there. Each test judges what a stranger on
the network could see, and what lands in the process logs and the records:

- /metrics and /admin/* answer on the admin listeners only (loopback), never the public port.
- A known key, its every 8 characters, a `user`, the tenant keys and the admin token are in
  no /metrics page (any port), no process log (replicas' included), no requests.csv and no
  trace.jsonl.
- team-a's key with X-Client-Id: team-b and X-Client-Weight: 100 is charged to team-a.
- A secret whose variable is not set stops `fairway serve` with an error naming the field.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import yaml

from router.proxy.ports import free_ports
from router.runtime.processes import stop_all, wait_healthy
from tests.live_helpers import ROOT, tokenizer_dir
from workers.emulated.cli import emulated_command

KEY = "sk-live-SECRETabcd1234"  # the open proxy's caller
USER = "alice@example.com"
TEAM_A, TEAM_B = "sk-team-a-SECRET-0001", "sk-team-b-SECRET-0002"
ADMIN = "admin-SECRET-token-77"
SECRETS = (KEY, TEAM_A, TEAM_B, ADMIN)
BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 2}
REPLICAS = 2 if shutil.which("redis-server") else 1


@dataclass
class Fleet:
    open: str
    open_admin: str
    keyed: str
    keyed_admins: list[str]  # one per replica
    scratch: Path


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    scratch = Path(tempfile.mkdtemp(prefix="fairway-secrets-"))
    model = tokenizer_dir()
    worker, open_port, open_admin, keyed_port, *keyed_admins = free_ports(4 + REPLICAS)
    (scratch / "team-b.key").write_text(TEAM_B + "\n")
    (scratch / "admin.token").write_text(ADMIN + "\n")
    common = {"model": str(model), "health_interval": 0.2, "workers": {"urls": [url(worker)]}}
    configs = {
        "open": {
            **common,
            "port": open_port,
            "admin_port": open_admin,
            "record_dir": str(scratch / "open-records"),
        },
        "keyed": {
            **common,
            "port": keyed_port,
            "routers": REPLICAS,
            "replica_ports": keyed_admins,
            "record_dir": str(scratch / "keyed-records"),
            "trust_client_headers": True,
            "admin_token_file": str(scratch / "admin.token"),
            "tenants": [
                {"api_key_env": "FAIRWAY_TEST_TEAM_A", "client": "team-a", "weight": 2},
                {"api_key_file": str(scratch / "team-b.key"), "client": "team-b"},
            ],
        },
    }
    argvs = {"worker": emulated_command(worker, model, speed=50)}
    for name, config in configs.items():
        (scratch / f"{name}.yaml").write_text(yaml.safe_dump(config))
        argvs[name] = [sys.executable, "-m", "router.cli", "serve", "--config"]
        argvs[name].append(str(scratch / f"{name}.yaml"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FAIRWAY_TEST_TEAM_A": TEAM_A}
    procs = [
        subprocess.Popen(
            argv,
            stdout=(scratch / f"{name}.log").open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        for name, argv in argvs.items()
    ]
    try:
        ports = [worker, open_port, open_admin, keyed_port, *keyed_admins]
        for port in ports:
            wait_healthy(url(port), timeout=90)
        yield Fleet(
            url(open_port), url(open_admin), url(keyed_port), list(map(url, keyed_admins)), scratch
        )
    finally:
        stop_all(procs, 40.0)
        shutil.rmtree(scratch, ignore_errors=True)


async def ask(
    s: aiohttp.ClientSession, method: str, where: str, **kw
) -> tuple[int, str, dict[str, str]]:
    async with s.request(method, where, **kw) as r:
        return r.status, await r.text(), dict(r.headers)


async def status(s: aiohttp.ClientSession, method: str, where: str, **kw) -> int:
    return (await ask(s, method, where, **kw))[0]


def leaks(text: str) -> list[str]:
    """Any 8 characters of a secret, or the user, where they occur in `text`."""
    found = {s[i : i + 8] for s in SECRETS for i in range(len(s) - 7) if s[i : i + 8] in text}
    return sorted(found) + ([USER] if USER in text else [])


def records(folder: Path) -> list[dict[str, str]]:
    return [
        row for path in sorted(folder.rglob("requests.csv")) for row in csv.DictReader(path.open())
    ]


class TestListeners:
    def test_a_stranger_on_the_public_ports_reaches_only_the_api(self, fleet: Fleet) -> None:
        async def go() -> None:
            auth = {"Authorization": f"Bearer {ADMIN}"}
            async with aiohttp.ClientSession() as s:
                for base in (fleet.open, fleet.keyed):
                    for path in ("/metrics", "/admin/workers", "/admin/replica", "/%6detrics"):
                        got, text, _ = await ask(s, "GET", base + path, headers=auth)
                        assert got == 404, (base, path, got)
                        assert json.loads(text)["error"]["type"] == "not_found_error"
                    assert await status(s, "GET", f"{base}/health") == 200
                    assert await status(s, "GET", f"{base}/v1/models") == 200
                assert await status(s, "GET", f"{fleet.open_admin}/metrics") == 200
                wrong = {"Authorization": f"Bearer {ADMIN[:-1]}"}
                for admin in fleet.keyed_admins:
                    workers = f"{admin}/admin/workers"
                    assert await status(s, "GET", f"{admin}/metrics") == 200
                    assert await status(s, "GET", workers) == 401
                    assert await status(s, "GET", workers, headers=wrong) == 401
                    assert await status(s, "GET", workers, headers=auth) == 200
                off = await status(s, "GET", f"{fleet.open_admin}/admin/workers", headers=auth)
                assert off == 403, "no admin token configured: the admin API is off"

        asyncio.run(asyncio.wait_for(go(), 60))


class TestIdentity:
    def test_team_as_key_cannot_be_charged_to_team_b(self, fleet: Fleet) -> None:
        async def go() -> None:
            forged = {
                "Authorization": f"Bearer {TEAM_A}",
                "X-Client-Id": "team-b",
                "X-Client-Weight": "100",
            }
            team_b = {"Authorization": f"Bearer {TEAM_B}"}
            wrong = {"Authorization": f"Bearer {TEAM_A}x"}
            completions = f"{fleet.keyed}/v1/completions"
            async with aiohttp.ClientSession() as s:
                body = {**BODY, "user": "team-b"}
                assert await status(s, "POST", completions, json=body, headers=forged) == 200
                assert await status(s, "POST", completions, json=BODY, headers=team_b) == 200
                assert await status(s, "POST", completions, json=BODY, headers=wrong) == 401

        asyncio.run(asyncio.wait_for(go(), 60))
        charged = {
            (r["client"], float(r["weight"])) for r in records(fleet.scratch / "keyed-records")
        }
        assert ("team-a/team-b", 2.0) in charged and ("team-b", 1.0) in charged, charged
        assert all(c.split("/")[0] in ("team-a", "team-b") and w <= 2 for c, w in charged), charged


class TestNothingLeaks:
    def test_no_key_user_or_token_in_metrics_logs_or_records(self, fleet: Fleet) -> None:
        async def go() -> dict[str, str]:
            pages: dict[str, str] = {}
            key = {"Authorization": f"Bearer {KEY}"}
            sends = [
                (fleet.open, BODY, key),
                (fleet.open, {**BODY, "stream": True}, key),
                (fleet.open, {**BODY, "user": USER}, key),
                (fleet.open, {**BODY, "user": USER}, {}),
                (fleet.open, {**BODY, "max_tokens": 0}, key),  # refused: 400
                (fleet.keyed, {**BODY, "user": USER}, {"Authorization": f"Bearer {TEAM_A}"}),
                (fleet.keyed, BODY, {"Authorization": f"Bearer {TEAM_B}", "X-Client-Id": "gw-7"}),
                (fleet.keyed, BODY, key),  # not a tenant's key: 401
            ]
            fresh = aiohttp.TCPConnector(force_close=True)  # the kernel spreads new connections
            async with aiohttp.ClientSession(connector=fresh) as s:
                for base, body, headers in sends:
                    for _ in range(2 * REPLICAS):
                        got = await status(
                            s, "POST", f"{base}/v1/completions", json=body, headers=headers
                        )
                        assert got < 500, (body, headers)
                for where in (fleet.open, fleet.keyed, fleet.open_admin, *fleet.keyed_admins):
                    pages[where] = (await ask(s, "GET", f"{where}/metrics"))[1]
            return pages

        pages = asyncio.run(asyncio.wait_for(go(), 90))
        assert 'client="key:' in pages[fleet.open_admin], "the keyed caller, by pseudonym"
        found = {
            **{f"/metrics at {where}": text for where, text in pages.items()},
            **{
                str(path.relative_to(fleet.scratch)): path.read_text(errors="replace")
                for pattern in ("*.log", "*.csv", "*.jsonl")
                for path in fleet.scratch.rglob(pattern)
            },
        }
        assert sum(name.endswith("requests.csv") for name in found) == 1 + REPLICAS
        assert "replica 0" in found["keyed.log"] or REPLICAS == 1, "the replicas log there too"
        for where, text in found.items():
            assert not leaks(text), (where, leaks(text))


def test_a_secret_not_set_is_a_config_error_naming_the_field(tmp_path: Path) -> None:
    config = {
        "admin_token": ADMIN,
        "tenants": [{"api_key_env": "FAIRWAY_TEST_UNSET", "client": "a"}],
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k != "FAIRWAY_TEST_UNSET"}
    argv = [sys.executable, "-m", "router.cli", "serve", "--config", str(tmp_path / "c.yaml")]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "tenants.0" in done.stderr and "api_key_env" in done.stderr, done.stderr
    assert "FAIRWAY_TEST_UNSET" in done.stderr and ADMIN not in done.stderr + done.stdout
