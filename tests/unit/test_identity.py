"""Who a request is charged to (router/proxy/identity.py): with tenants, the API key decides the
tenant, and no header or body field moves a key's charge to another tenant or raises its
weight; without them, keys and users are pseudonyms; the admin token is checked alike."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from aiohttp.test_utils import make_mocked_request

from router.proxy.errors import APIError
from router.proxy.identity import (
    authenticate,
    check_admin,
    client_identity,
    metric_labels,
    pseudonym,
)
from router.proxy.metrics import ClientLabels
from router.proxy.settings import ProxySettings, Tenant, keyed

KEY_A, KEY_B = "sk-team-a-0123456789", "sk-team-b-0123456789"
TENANTS = {KEY_A: Tenant("team-a", 2.0), KEY_B: Tenant("team-b", 5.0)}


def settings(**kw) -> ProxySettings:
    kw.setdefault("tenants", keyed(TENANTS))
    return ProxySettings(model_name="tiny", client_salt=b"pepper", **kw)


def who(s: ProxySettings, headers: dict[str, str], body: dict | None = None) -> tuple[str, float]:
    http = make_mocked_request("POST", "/v1/completions", headers=headers)
    return client_identity(http, body or {}, authenticate(http, s), s)


@dataclass
class Forgery:
    name: str
    headers: dict[str, str] = field(default_factory=dict)
    body: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return self.name


FORGERIES = [
    Forgery("id_b", {"X-Client-Id": "team-b"}),
    Forgery("weight_100", {"X-Client-Weight": "100"}),
    Forgery("id_b_weight_100", {"X-Client-Id": "team-b", "X-Client-Weight": "100"}),
    Forgery("weight_max", {"X-Client-Weight": "1000"}),
    Forgery("id_b_slash", {"X-Client-Id": "team-b/x"}),
    Forgery("id_dotdot", {"X-Client-Id": "../team-b"}),
    Forgery("id_empty", {"X-Client-Id": ""}),
    Forgery("user_b", body={"user": "team-b"}),
    Forgery("user_b_id_b", {"X-Client-Id": "team-b"}, {"user": "team-b"}),
    Forgery("second_key_header", {"X-Api-Key": KEY_B}),
    Forgery("key_in_body", body={"api_key": KEY_B, "user": KEY_B}),
    Forgery("weight_nan", {"X-Client-Weight": "nan"}),
    Forgery("weight_negative", {"X-Client-Weight": "-3"}),
]


class TestTheKeyDecidesTheTenant:
    @pytest.mark.parametrize("trust", [False, True], ids=["untrusted", "gateway"])
    @pytest.mark.parametrize("forgery", FORGERIES, ids=str)
    def test_nothing_moves_key_a_to_b_or_raises_its_weight(
        self, forgery: Forgery, trust: bool
    ) -> None:
        s = settings(trust_client_headers=trust)
        headers = {"Authorization": f"Bearer {KEY_A}", **forgery.headers}
        try:
            client, weight = who(s, headers, forgery.body)
        except APIError as e:  # a malformed header from a gateway: refused, charged nowhere
            assert trust and e.status == 400, (e.status, e.message)
            return
        assert client == "team-a" or client.startswith("team-a/"), client
        assert weight <= 2.0, weight
        if not trust:
            assert (client, weight) == ("team-a", 2.0), "headers are ignored untrusted"

    def test_a_gateway_names_a_sub_client_and_may_lower_the_weight(self) -> None:
        s = settings(trust_client_headers=True)
        key = {"Authorization": f"Bearer {KEY_A}"}
        assert who(s, {**key, "X-Client-Id": "bob"}) == ("team-a/bob", 2.0)
        assert who(s, {**key, "X-Client-Id": "bob", "X-Client-Weight": "0.5"}) == (
            "team-a/bob",
            0.5,
        )
        assert who(s, {**key, "X-Client-Weight": "100"}) == ("team-a", 2.0), "never raised"
        assert who(s, {"Authorization": f"Bearer {KEY_B}", "X-Client-Id": "bob"}) == (
            "team-b/bob",
            5.0,
        )

    @pytest.mark.parametrize(
        "auth",
        [
            None,
            "",
            "Bearer ",
            f"bearer {KEY_A}",
            f"Basic {KEY_A}",
            f"Bearer {KEY_A} ",
            f"Bearer {KEY_A[:-1]}",
            f"Bearer {KEY_A}0",
            "Bearer sk-\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9",
        ],
    )
    def test_any_other_key_is_a_401(self, auth: str | None) -> None:
        headers = {} if auth is None else {"Authorization": auth}
        with pytest.raises(APIError) as error:
            who(settings(trust_client_headers=True), {**headers, "X-Client-Id": "team-a"})
        assert error.value.status == 401


class TestWithoutTenants:
    KEY = "sk-live-SECRETabcd1234"

    def test_a_key_and_a_user_are_pseudonyms_the_router_tells_apart(self) -> None:
        s = settings(tenants={})
        client, weight = who(s, {"Authorization": f"Bearer {self.KEY}"})
        assert client.startswith("key:") and weight == 1.0
        assert not any(self.KEY[i : i + 4] in client for i in range(len(self.KEY) - 3))
        assert who(s, {"Authorization": f"Bearer {self.KEY}"})[0] == client, "stable"
        assert who(s, {"Authorization": "Bearer sk-live-other-key"})[0] != client
        other_salt = ProxySettings(model_name="tiny", client_salt=b"salt")
        assert who(other_salt, {"Authorization": f"Bearer {self.KEY}"})[0] != client
        user = who(s, {}, {"user": "alice@example.com"})[0]
        assert user == "user:" + pseudonym(b"pepper", "user", "alice@example.com")
        assert "alice" not in user
        assert who(s, {}) == ("anonymous", 1.0)

    def test_headers_count_only_from_a_trusted_gateway(self) -> None:
        forged = {"X-Client-Id": "team-b", "X-Client-Weight": "100"}
        assert who(settings(tenants={}), forged) == ("anonymous", 1.0)
        assert who(settings(tenants={}, trust_client_headers=True), forged) == ("team-b", 100.0)


class TestAdminToken:
    def check(self, token: str | None, auth: str | None) -> int:
        headers = {} if auth is None else {"Authorization": auth}
        try:
            check_admin(make_mocked_request("GET", "/admin/workers", headers=headers), token)
        except APIError as e:
            return e.status
        return 200

    def test_only_the_token_passes(self) -> None:
        token = "admin-token-5678"
        assert self.check(token, f"Bearer {token}") == 200
        for wrong in (None, "", token, f"Bearer {token[:-1]}", f"Bearer {token}x", "Bearer \u00e9"):
            assert self.check(token, wrong) == 401, wrong
        assert self.check(None, f"Bearer {token}") == 403, "no token: the admin API is off"


class TestMetricLabels:
    def test_named_users_show_by_name_everyone_else_by_pseudonym_or_other(self) -> None:
        s = settings(tenants=keyed(TENANTS), client_labels=("alice@example.com",))
        labels = ClientLabels(*metric_labels(s))
        alice = "user:" + pseudonym(b"pepper", "user", "alice@example.com")
        bob = "user:" + pseudonym(b"pepper", "user", "bob@example.com")
        assert labels.label(alice) == "alice@example.com"
        assert labels.label(bob) == "other", "a user gets a series only when configured"
        assert labels.label("team-a/bob") == "team-a"

    def test_a_count_gives_pseudonyms_first_come(self) -> None:
        labels = ClientLabels(*metric_labels(settings(tenants={}, client_labels=2)))
        bob = "user:" + pseudonym(b"pepper", "user", "bob@example.com")
        assert labels.label(bob) == bob, "already a pseudonym"
        named = labels.label("gateway-name")
        assert named.startswith("id:") and "gateway" not in named
        assert labels.label("third") == "other"
