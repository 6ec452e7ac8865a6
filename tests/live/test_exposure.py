"""Who reaches what, and what leaves (issue 27 A, B), over real HTTP against emulated workers.

- The public listener serves the OpenAI API and /health; /metrics and /admin/* answer on the
  admin listener only, however the path is spelled.
- A known API key and `user` sent through every kind of request appear nowhere outside: not on
  /metrics (either listener), in any log record, in requests.csv or trace.jsonl; not the key,
  not any 8 characters of it, not the user.
- With tenants and a trusted gateway, team-a's key with X-Client-Id: team-b and
  X-Client-Weight: 100 is charged to team-a's sub-client at team-a's weight.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import aiohttp
import pytest

from router.proxy.settings import Tenant, keyed
from tests.live_helpers import ProxyURL, emulated_workers, proxy, run

KEY = "sk-live-SECRETabcd1234"
USER = "alice@example.com"
BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 2}


def leaks(text: str) -> list[str]:
    """The key, any 8 characters of it, or the user, where they occur in `text`."""
    found = {KEY[i : i + 8] for i in range(len(KEY) - 7) if KEY[i : i + 8] in text}
    return sorted(found) + ([USER] if USER in text else [])


async def status_of(s: aiohttp.ClientSession, method: str, url: str, **kw) -> int:
    async with s.request(method, url, **kw) as r:
        answer = await r.read()
        if r.status >= 400:
            error = json.loads(answer)["error"]  # the OpenAI shape, always
            assert {"message", "type", "param", "code"} <= set(error), error
        return r.status


class TestListeners:
    def test_metrics_and_admin_answer_on_the_admin_listener_only(self) -> None:
        async def go() -> None:
            async with (
                emulated_workers(1, speed=20) as urls,
                proxy(urls, admin_token="admin-token-5678") as (base, _),
                aiohttp.ClientSession() as s,
            ):
                auth = {"Authorization": "Bearer admin-token-5678"}
                public = {
                    ("GET", "/health"): 200,
                    ("GET", "/v1/models"): 200,
                    ("POST", "/v1/completions"): 200,
                    ("GET", "/metrics"): 404,
                    ("GET", "/%6detrics"): 404,
                    ("GET", "/admin/workers"): 404,
                    ("GET", "/admin/%77orkers"): 404,
                    ("POST", "/admin/workers"): 404,
                    ("DELETE", "/admin/workers?id=0"): 404,
                }
                for (method, path), want in public.items():
                    kw = {"json": BODY} if path == "/v1/completions" else {"headers": auth}
                    got = await status_of(s, method, f"{base}{path}", **kw)
                    assert got == want, (method, path, got)
                admin = {
                    ("GET", "/health"): 200,
                    ("GET", "/metrics"): 200,
                    ("GET", "/%6detrics"): 200,
                    ("GET", "/admin/workers"): 200,
                }
                for (method, path), want in admin.items():
                    got = await status_of(s, method, f"{base.admin}{path}", headers=auth)
                    assert got == want, (method, path, got)
                assert await status_of(s, "GET", f"{base.admin}/admin/workers") == 401

        run(go, timeout=60)


class TestNothingLeaks:
    def test_a_key_and_a_user_appear_in_no_metric_log_or_record(self, tmp_path, caplog) -> None:
        caplog.set_level(logging.DEBUG)
        pages: dict[str, str] = {}

        async def go() -> None:
            settings = {
                "record_dir": str(tmp_path),
                "max_retries": 1,
                "trust_client_headers": False,
            }
            async with (
                emulated_workers(1, speed=20) as urls,
                # a dead second worker: retries, and the warnings they log
                proxy([*urls, "http://127.0.0.1:9"], **settings) as (base, _),
                aiohttp.ClientSession() as s,
            ):
                await send_everything(s, base)
                for name, url in (("public", base), ("admin", base.admin)):
                    async with s.get(f"{url}/metrics") as r:
                        pages[name] = f"{r.status} {await r.text()}"

        run(go, timeout=90)
        assert pages["public"].startswith("404"), pages["public"][:200]
        assert pages["admin"].startswith("200") and 'client="key:' in pages["admin"]
        logs = "\n".join(r.getMessage() + str(r.exc_info or "") for r in caplog.records)
        assert "failed before answering" in logs, "the dead worker was tried and logged"
        records = {
            p.name: p.read_text() for p in (tmp_path / "requests.csv", tmp_path / "trace.jsonl")
        }
        rows = list(csv.DictReader((tmp_path / "requests.csv").open()))
        assert len(rows) >= 6 and {r["client"].split(":")[0] for r in rows} == {"key", "user"}
        for where, text in {**pages, "logs": logs, **records}.items():
            assert not leaks(text), (where, leaks(text))


async def send_everything(s: aiohttp.ClientSession, base: ProxyURL) -> None:
    """The key and the user through every kind of request: answered, streamed, chat, refused
    (400, 404), and with the user refused for its length."""
    key = {"Authorization": f"Bearer {KEY}"}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    sends = [
        (BODY, key, 200),
        ({**BODY, "stream": True}, key, 200),
        ({**BODY, "user": USER}, {}, 200),
        ({**BODY, "user": USER, "stream": True}, key, 200),
        ({**BODY, "max_tokens": -1}, key, 400),
        ({**BODY, "model": KEY}, key, 404),
        ({**BODY, "user": USER * 10}, key, 400),
    ]
    url = f"{base}/v1/completions"
    for body, headers, want in sends:
        assert await status_of(s, "POST", url, json=body, headers=headers) == want, body
    for headers, extra in ((key, {}), ({}, {"user": USER})):
        chat_url = f"{base}/v1/chat/completions"
        assert await status_of(s, "POST", chat_url, json={**chat, **extra}, headers=headers) == 200
    for _ in range(2):  # round robin: the dead worker's turn comes
        assert await status_of(s, "POST", url, json=BODY, headers=key) == 200


class TestImpersonation:
    TENANTS = {
        "sk-team-a-0123456789": Tenant("team-a", 1.0),
        "sk-team-b-0123456789": Tenant("team-b", 1.0),
    }

    @pytest.mark.parametrize("trust", [True, False], ids=["gateway", "untrusted"])
    def test_team_as_key_is_charged_to_team_a_whatever_the_headers_say(
        self, tmp_path: Path, trust: bool
    ) -> None:
        page: list[str] = []

        async def go() -> None:
            settings = {"trust_client_headers": trust, "record_dir": str(tmp_path)}
            async with (
                emulated_workers(1, speed=20) as urls,
                proxy(urls, "vtc", tenants=keyed(self.TENANTS), **settings) as (base, _),
                aiohttp.ClientSession() as s,
            ):
                forged = {
                    "Authorization": "Bearer sk-team-a-0123456789",
                    "X-Client-Id": "team-b",
                    "X-Client-Weight": "100",
                }
                body = {**BODY, "user": "team-b"}
                url = f"{base}/v1/completions"
                assert await status_of(s, "POST", url, json=body, headers=forged) == 200
                async with s.get(f"{base.admin}/metrics") as r:
                    page.append(await r.text())

        run(go, timeout=60)
        rows = list(csv.DictReader((tmp_path / "requests.csv").open()))
        charged = [(r["client"], float(r["weight"])) for r in rows]
        assert charged == [("team-a/team-b" if trust else "team-a", 1.0)], charged
        assert 'fairway_client_service_tokens_total{client="team-a"}' in page[0]
        assert 'client="team-b' not in page[0]
