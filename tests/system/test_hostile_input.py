"""Hostile and odd input against a real proxy (`fairway serve`, its own process) on 127.0.0.1,
in front of an emulated worker.

Every case is checked three ways: no 5xx; every error in the OpenAI shape
({"error": {"message", "type", "param", "code"}}, the parameter named); and /health answering
within 100 ms all the while (a poller in a thread of its own hits it every few milliseconds), so
no input can stall the event loop. Two proxies: a gateway one that trusts X-Client-* headers,
and one with API keys (tenants).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from router.proxy.metrics import ClientLabels, RouterMetrics
from router.proxy.ports import free_ports
from router.proxy.service.config import validate_config
from router.proxy.service.serve import settings_of
from router.proxy.settings import Tenant, keyed
from router.runtime.processes import stop_all, wait_healthy
from tests.live_helpers import ROOT, tokenizer_dir
from workers.emulated.cli import emulated_command

HEALTH_BOUND = 0.1  # seconds: /health must answer within this during every case
BODY_TIMEOUT = 1.0  # the proxies' body deadline here (the default is 30 s)
CLIENT_LABELS = 5
KEYS = {"alpha": "sk-alpha-0123456789", "beta": "sk-beta-0123456789"}
ANY = object()  # any param
MB = 1024 * 1024


@dataclass
class Servers:
    gateway: str  # trusts X-Client-Id / X-Client-Weight
    keyed: str  # API keys required
    gateway_pid: int
    gateway_admin: str  # its admin listener: /metrics


@pytest.fixture(scope="module")
def servers():
    scratch = Path(tempfile.mkdtemp(prefix="fairway-hostile-"))
    model = tokenizer_dir()
    worker_port, gateway_port, keyed_port, gateway_admin, keyed_admin = free_ports(5)
    worker = f"http://127.0.0.1:{worker_port}"
    common = (
        f"model: {model}\npolicy: {{name: round_robin}}\nhealth_interval: 0.2\n"
        f"timeouts: {{body: {BODY_TIMEOUT}}}\nlimits: {{client_labels: {CLIENT_LABELS}}}\n"
        f"workers: {{urls: [{worker}]}}\n"
    )
    (scratch / "gateway.yaml").write_text(
        f"{common}port: {gateway_port}\nadmin_port: {gateway_admin}\ntrust_client_headers: true\n"
    )
    tenants = "".join(
        f"  - {{api_key: {key}, client: {name}, weight: 2}}\n" for name, key in KEYS.items()
    )
    (scratch / "keyed.yaml").write_text(
        f"{common}port: {keyed_port}\nadmin_port: {keyed_admin}\ntenants:\n{tenants}"
    )
    serve = [sys.executable, "-m", "router.cli", "serve", "--config"]
    argvs = {
        "worker": emulated_command(worker_port, model, speed=50),
        "gateway": [*serve, str(scratch / "gateway.yaml")],
        "keyed": [*serve, str(scratch / "keyed.yaml")],
    }
    procs = {
        name: subprocess.Popen(
            argv, stdout=(scratch / f"{name}.log").open("wb"), stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
        )
        for name, argv in argvs.items()
    }  # fmt: skip
    try:
        urls = [f"http://127.0.0.1:{p}" for p in (worker_port, gateway_port, keyed_port)]
        for url in urls:
            wait_healthy(url, timeout=60)
        yield Servers(urls[1], urls[2], procs["gateway"].pid, f"http://127.0.0.1:{gateway_admin}")
    finally:
        # A proxy drains its connections on SIGTERM, lingering on a refused upload for up to
        # 10 s (aiohttp reads what a client still sends so it can see the answer): not waited.
        stop_all(procs.values(), 2.0)
        shutil.rmtree(scratch, ignore_errors=True)


# ----------------------------------------------------------------------------- helpers


class HealthWatch:
    """GET /health in a loop on a thread of its own (keep-alive), keeping the slowest answer."""

    def __init__(self, base: str) -> None:
        self.host, self.port = base.removeprefix("http://").split(":")
        self.worst, self.count = 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        conn = http.client.HTTPConnection(self.host, int(self.port), timeout=5)
        while not self._stop.is_set():
            start = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            self.worst = max(self.worst, time.perf_counter() - start)
            self.count += 1
            time.sleep(0.005)
        conn.close()

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        while self.count == 0:  # one answer first: the connection is up
            time.sleep(0.001)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


async def _request(url: str, method: str, data: object, headers: dict) -> Answer:
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, url, data=data, headers=headers) as r,
    ):
        return Answer(r.status, r.content_type, await r.read())


async def raw_http(base: str, head: bytes, body: bytes, wait: float = 10.0) -> Answer:
    """Send bytes as they are (a request aiohttp's client would not send); read the answer."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head + body)
        await writer.drain()
        async with asyncio.timeout(wait):
            headers = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: (\d+)", headers)
            payload = await reader.readexactly(int(length.group(1))) if length else b""
    finally:
        writer.close()
    status = int(headers.split(b" ", 2)[1])
    ctype = re.search(rb"(?i)content-type: ([^;\r\n]+)", headers)
    return Answer(status, ctype.group(1).decode() if ctype else "", payload)


def assert_openai_error(answer: Answer, status: int, param: object) -> None:
    assert answer.status == status, (answer.status, answer.body[:300])
    assert answer.content_type == "application/json", (answer.content_type, answer.body[:200])
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert "Traceback" not in error["message"] and "127.0.0.1" not in error["message"], error
    if param is not ANY:
        assert error["param"] == param, error


# ----------------------------------------------------------------------------- the table


def completion(**fields: object) -> dict:
    return {"model": "tiny", "prompt": "hello there", "max_tokens": 2, **fields}


def chat(*messages: object, **fields: object) -> dict:
    return {"model": "tiny", "messages": list(messages), "max_tokens": 2, **fields}


def user(content: object) -> dict:
    return {"role": "user", "content": content}


def nested(depth: int) -> str:
    return '{"model": "tiny", "prompt": "x", "extra": ' + "[" * depth + "]" * depth + "}"


async def slow_sender(base: str) -> Answer:
    """Half a body, then silence: the proxy must give up on it, not wait forever."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n"
    )
    return await raw_http(base, head, b'{"model": "tiny", "prompt": "', wait=BODY_TIMEOUT + 5)


async def chunked_20mb(base: str) -> Answer:
    async def body():
        for _ in range(20):
            yield b"x" * MB

    return await _request(f"{base}/v1/completions", "POST", body(), {})


@dataclass
class Case:
    name: str
    body: object = None  # a dict or list goes as JSON; str and bytes as they are
    status: int = 400
    param: object = None
    path: str = "/v1/completions"
    method: str = "POST"
    headers: dict = field(default_factory=dict)
    keyed: bool = False  # to the proxy with API keys
    send: Callable[[str], Awaitable[Answer]] | None = None  # a request of its own making
    check: Callable[[dict], None] | None = None  # on a 200's JSON

    def __str__(self) -> str:
        return self.name


def _usage_is(n: int) -> Callable[[dict], None]:
    def check(answer: dict) -> None:
        assert answer["usage"]["completion_tokens"] == n, answer["usage"]

    return check


TOOL_TURN = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}
CHAT = "/v1/chat/completions"
CASES = [
    # Token ids and prompts.
    Case("ids_negative", completion(prompt=[-1]), param="prompt"),
    Case("ids_2_pow_40", completion(prompt=[2**40]), param="prompt"),
    Case("ids_past_the_vocabulary", completion(prompt=[1, 4000]), param="prompt"),
    Case("ids_float", completion(prompt=[1.5]), param="prompt"),
    Case("ids_bool", completion(prompt=[True, 5]), param="prompt"),
    Case("ids_empty_list", completion(prompt=[]), param="prompt"),
    Case("prompt_empty_string", completion(prompt=""), param="prompt"),
    Case("prompt_object", completion(prompt={"text": "hi"}), param="prompt"),
    Case("prompt_null", completion(prompt=None), param="prompt"),
    Case("prompt_lone_surrogate", '{"model": "tiny", "prompt": "a\\ud800b"}', param="prompt"),
    Case("batch_mixed", completion(prompt=["a", [1, 2]]), param="prompt"),
    Case("batch_of_string_lists", completion(prompt=[["a"]]), param="prompt"),
    Case("batch_of_1025", completion(prompt=["a"] * 1025), param="prompt"),
    Case("batch_one_too_long", completion(prompt=["a", "word " * 5000]), param="max_tokens"),
    Case("prompt_5000_tokens", completion(prompt="word " * 5000), param="max_tokens"),
    Case("prompt_200k_words", completion(prompt="word " * 200_000), param="prompt"),
    # Chat messages.
    Case(
        "chat_lone_surrogate",
        '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
        path=CHAT,
        param="messages",
    ),
    Case(
        "chat_role_surrogate",
        '{"model": "tiny", "messages": [{"role": "\\udfff", "content": "hi"}]}',
        path=CHAT,
        param="messages",
    ),
    Case(
        "chat_text_part_123",
        chat(user([{"type": "text", "text": 123}])),
        path=CHAT,
        param="messages",
    ),
    Case("chat_part_without_type", chat(user([{"text": "x"}])), path=CHAT, param="messages"),
    Case("chat_part_not_object", chat(user(["x"])), path=CHAT, param="messages"),
    Case("chat_content_number", chat(user(5)), path=CHAT, param="messages"),
    Case("chat_user_null_content", chat(user(None)), path=CHAT, param="messages"),
    Case("chat_messages_string", chat() | {"messages": "hi"}, path=CHAT, param="messages"),
    Case("chat_no_role", chat({"content": "x"}), path=CHAT, param="messages"),
    Case("chat_200k_words", chat(user("word " * 200_000)), path=CHAT, param="messages"),
    # The body and its JSON.
    Case("json_syntax", "{not json"),
    Case("json_array", [1, 2]),
    Case("json_nested_100k", nested(100_000)),
    Case("json_nested_65", nested(65)),
    Case("json_invalid_utf8", b'{"model": "tiny", "prompt": "\xff\xfe"}'),
    Case(
        "json_half_mb_of_numbers", {"model": "gpt-9", "x": [0] * 170_000}, status=404, param="model"
    ),
    Case("json_250k_arrays", completion(x=[[]] * 250_000)),
    Case("body_20mb", b"x" * (20 * MB), status=413),
    Case("body_20mb_chunked", status=413, send=chunked_20mb),
    Case("body_half_sent_then_held", status=408, send=slow_sender),
    # Fields.
    Case("model_missing", {"prompt": "x"}, param="model"),
    Case("model_unknown", completion(model="gpt-9"), status=404, param="model"),
    Case("max_tokens_negative", completion(max_tokens=-1), param="max_tokens"),
    Case("max_tokens_string", completion(max_tokens="5"), param="max_tokens"),
    Case("max_tokens_float", completion(max_tokens=2.5), param="max_tokens"),
    Case("n_zero", completion(n=0), param="n"),
    Case("n_1000", completion(n=1000), param="n"),
    Case("best_of_3", completion(n=1, best_of=3), param="best_of"),
    Case("stream_string", completion(stream="yes"), param="stream"),
    Case(
        "stream_options_string", completion(stream=True, stream_options="x"), param="stream_options"
    ),
    Case("user_number", completion(user=5), param="user"),
    Case("user_1000_chars", completion(user="u" * 1000), param="user"),
    # Identity: X-Client-* honoured (gateway proxy), API keys (keyed proxy).
    Case("weight_nan", completion(), headers={"X-Client-Weight": "nan"}, param="X-Client-Weight"),
    Case("weight_inf", completion(), headers={"X-Client-Weight": "inf"}, param="X-Client-Weight"),
    Case(
        "weight_negative", completion(), headers={"X-Client-Weight": "-1"}, param="X-Client-Weight"
    ),
    Case("weight_1e9", completion(), headers={"X-Client-Weight": "1e9"}, param="X-Client-Weight"),
    Case(
        "weight_word", completion(), headers={"X-Client-Weight": "heavy"}, param="X-Client-Weight"
    ),
    Case(
        "client_id_200_chars", completion(), headers={"X-Client-Id": "c" * 200}, param="X-Client-Id"
    ),
    Case("key_missing", completion(), status=401, keyed=True),
    Case(
        "key_unknown",
        completion(),
        status=401,
        keyed=True,
        headers={"Authorization": "Bearer sk-nobody-0123456789"},
    ),
    Case(
        "key_known",
        completion(),
        status=200,
        keyed=True,
        headers={"Authorization": f"Bearer {KEYS['alpha']}"},
    ),
    Case(
        "key_known_weight_header_ignored",
        completion(),
        status=200,
        keyed=True,
        headers={"Authorization": f"Bearer {KEYS['beta']}", "X-Client-Weight": "nan"},
    ),
    # HTTP.
    Case("unknown_path", {}, status=404, path="/v1/nothing"),
    Case("wrong_method", None, status=405, method="GET"),
    Case("header_16kb", completion(), status=431, headers={"X-Big": "a" * 16_000}),
    Case("url_10kb", {}, status=414, path="/v1/" + "a" * 10_000),
    # Past the parser's own 64 KiB: answered below aiohttp (router/proxy/connections.py).
    Case("header_70kb", completion(), status=431, headers={"X-Big": "a" * 70_000}),
    Case("url_70kb", {}, status=431, path="/v1/" + "a" * 70_000),
    # vLLM's OpenAI server accepts these: so does the proxy.
    Case("batch_of_strings", completion(prompt=["a b", "c d e"]), status=200, check=_usage_is(4)),
    Case(
        "batch_of_token_lists",
        completion(prompt=[[1, 2, 3], [4, 5]]),
        status=200,
        check=_usage_is(4),
    ),
    Case(
        "chat_tool_call_turn",
        chat(user("hi"), TOOL_TURN, {"role": "tool", "tool_call_id": "c1", "content": "ok"}),
        path=CHAT,
        status=200,
    ),
    Case(
        "n_2_echo_logprobs", completion(n=2, echo=True, logprobs=1), status=200, check=_usage_is(4)
    ),
    Case("best_of_equal_to_n", completion(n=1, best_of=1), status=200),
    Case("chat_text_parts", chat(user([{"type": "text", "text": "hi"}])), path=CHAT, status=200),
]


async def send(case: Case, base: str) -> Answer:
    if case.send is not None:
        return await case.send(base)
    data, headers = case.body, {"Content-Type": "application/json", **case.headers}
    if isinstance(data, (dict, list)):
        data = json.dumps(data)
    return await _request(base + case.path, case.method, data, headers)


class TestEveryBadInputGetsAnOpenAIError:
    def test_the_table_is_large(self) -> None:
        assert len(CASES) >= 40 and len({c.name for c in CASES}) == len(CASES)

    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_case(self, servers: Servers, case: Case) -> None:
        base = servers.keyed if case.keyed else servers.gateway
        slowest = []
        for _ in range(3):  # a blocked loop is slow every time; a busy machine only now and then
            with HealthWatch(base) as health:
                answer = asyncio.run(asyncio.wait_for(send(case, base), 30))
            assert answer.status < 500, (answer.status, answer.body[:300])
            if case.status == 200:
                assert answer.status == 200, answer.body[:300]
                if case.check:
                    case.check(answer.json())
            else:
                assert_openai_error(answer, case.status, case.param)
            slowest.append(health.worst)
            if health.worst < HEALTH_BOUND:
                return
        raise AssertionError(f"/health took {', '.join(f'{t * 1000:.0f}' for t in slowest)} ms")


# ----------------------------------------------------------------------------- resources


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


class TestBoundedCost:
    def test_huge_prompts_leave_memory_as_it_was(self, servers: Servers) -> None:
        before = rss_mb(servers.gateway_pid)
        for case in CASES:
            if case.name in ("body_20mb", "body_20mb_chunked", "prompt_200k_words"):
                asyncio.run(send(case, servers.gateway))
        grown = rss_mb(servers.gateway_pid) - before
        assert grown < 100, f"RSS grew {grown:.0f} MB"

    def test_a_slow_sender_does_not_hold_up_others(self, servers: Servers) -> None:
        async def go() -> None:
            held = asyncio.create_task(slow_sender(servers.gateway))
            await asyncio.sleep(0.1)
            start = time.perf_counter()
            answer = await send(Case("ok", completion(), status=200), servers.gateway)
            assert answer.status == 200 and time.perf_counter() - start < BODY_TIMEOUT / 2
            assert (await held).status == 408

        asyncio.run(go())

    def test_metrics_keep_a_bounded_set_of_client_labels(self, servers: Servers) -> None:
        async def go() -> str:
            async with aiohttp.ClientSession() as s:
                for i in range(40):
                    headers = {"X-Client-Id": f"visitor-{i}"}
                    url = f"{servers.gateway}/v1/completions"
                    async with s.post(url, json=completion(max_tokens=1), headers=headers) as r:
                        assert r.status == 200
                async with s.get(f"{servers.gateway_admin}/metrics") as r:
                    return await r.text()

        text = asyncio.run(go())
        labels = set(re.findall(r'fairway_client_service_tokens_total\{client="([^"]*)"\}', text))
        assert "other" in labels and len(labels) <= CLIENT_LABELS + 1, labels


class TestClientLabels:
    def test_tenants_and_named_clients_by_name_a_count_by_pseudonym_the_rest_other(self) -> None:
        labels = ClientLabels(["t"], top=2, named={"user:0123456789ab": "alice"})
        labels.hide = lambda client: f"h({client})"
        got = [labels.label(c) for c in ("a", "b", "c", "t", "t/gw-7", "user:0123456789ab")]
        assert got == ["h(a)", "h(b)", "other", "t", "t", "alice"]
        assert labels.label("a") == "h(a)" and labels.label("c") == "other", "first come, kept"

    def test_series_only_grow_and_other_takes_the_rest(self) -> None:
        metrics = RouterMetrics(client_labels=1)
        metrics.service.labels("a").inc(1)
        metrics.ttft.labels("a").observe(0.1)
        metrics.service.labels("b").inc(5)  # "other": a holds the one label
        metrics.service.labels("b").inc(5)
        text = metrics.render().decode()
        assert 'fairway_client_service_tokens_total{client="a"} 1.0' in text
        assert 'fairway_client_service_tokens_total{client="other"} 10.0' in text


class TestTenantConfig:
    @pytest.mark.parametrize(
        "raw, field",
        [
            ({"tenants": [{"api_key": "sk-0123456789", "client": "a", "weight": "nan"}]}, "weight"),
            ({"tenants": [{"api_key": "sk-0123456789", "client": "a", "weight": 1e9}]}, "weight"),
            ({"tenants": [{"api_key": "short", "client": "a"}]}, "api_key"),
            ({"tenants": [{"api_key": "sk-0123456789", "client": ""}]}, "client"),
            ({"tenants": [{"api_key": "sk-0123456789", "client": c} for c in "ab"]}, "tenants"),
            ({"limits": {"max_body_bytes": 10}}, "limits.max_body_bytes"),
            ({"timeouts": {"body": 0}}, "timeouts.body"),
        ],
    )
    def test_bad_tenants_and_limits_name_the_field(self, raw: dict, field: str) -> None:
        with pytest.raises(ValueError, match=rf"{field}: "):
            validate_config(raw)

    def test_settings_carry_keys_and_limits(self) -> None:
        config = validate_config(
            {"tenants": [{"api_key": "sk-0123456789", "client": "a", "weight": 3}],
             "limits": {"client_labels": 7}, "timeouts": {"body": 5}}
        )  # fmt: skip
        s = settings_of(config)
        assert s.tenants == keyed({"sk-0123456789": Tenant("a", 3.0)})
        assert not s.trust_client_headers
        assert "sk-0123456789" not in repr(s) and "sk-0123456789" not in repr(config)
        assert (s.client_labels, s.body_timeout) == (7, 5.0)
