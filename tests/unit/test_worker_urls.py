"""The admin API's worker URLs (router/proxy/membership.py): what it takes, in one spelling, and
what it refuses with a 400 that names the field."""

from __future__ import annotations

import pytest

from router.proxy.errors import APIError
from router.proxy.membership import kv_events_endpoint, same_url, worker_url


@pytest.mark.parametrize(
    "given, spelled",
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
        ("HTTP://Worker-3.Example:8000", "http://worker-3.example:8000"),
        ("https://gpu.example:443/", "https://gpu.example"),
        ("http://gpu.example:80", "http://gpu.example"),
        ("http://[::1]:9000", "http://[::1]:9000"),
        ("https://gateway.example/pool/a/", "https://gateway.example/pool/a"),
    ],
)
def test_a_url_has_one_spelling(given: str, spelled: str) -> None:
    assert worker_url(given) == spelled
    assert worker_url(spelled) == spelled, "its own spelling is a fixed point"


@pytest.mark.parametrize(
    "given, says",
    [
        (None, "must be a string"),
        (8000, "must be a string"),
        ("", "must be a string"),
        ("127.0.0.1:8000", "scheme must be http or https"),
        ("ftp://127.0.0.1:8000", "scheme must be http or https"),
        ("http://", "no host"),
        ("http://:8000", "no host"),
        ("http://127.0.0.1:99999", "out of range"),
        ("http://127.0.0.1:-1", "Port"),
        ("http://127.0.0.1:eighty", "Port"),
        ("http://127.0.0.1:0", "port 0"),
        ("http://user:pw@127.0.0.1:8000", "credentials"),
        ("http://127.0.0.1:8000/?a=1", "no query or fragment"),
        ("http://127.0.0.1:8000/#top", "no query or fragment"),
        ("http://127.0.0.1 :8000", "spaces"),
        ("http://127.0.0.1:8000\n", "spaces"),
        ("http://[::1:8000", "Invalid IPv6"),
    ],
)
def test_nonsense_is_a_400_naming_the_url(given: object, says: str) -> None:
    with pytest.raises(APIError) as e:
        worker_url(given)
    assert e.value.status == 400 and e.value.param == "url"
    assert says.lower() in e.value.message.lower(), e.value.message


def test_kv_events_is_an_endpoint_or_nothing() -> None:
    assert kv_events_endpoint(None) is None
    assert kv_events_endpoint("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"
    for bad in ("", 5557, ["tcp://x:1"]):
        with pytest.raises(APIError) as e:
            kv_events_endpoint(bad)
        assert e.value.status == 400 and e.value.param == "kv_events"


def test_pool_urls_compare_in_their_one_spelling() -> None:
    assert same_url("http://127.0.0.1:8000/") == same_url("HTTP://127.0.0.1:8000")
    assert same_url("not a url/") == "not a url", "a URL the API would refuse is kept as given"
