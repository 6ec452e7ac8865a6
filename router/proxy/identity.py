"""Who a request is charged to, and what of that may be shown.

One source of truth: when tenants are configured, the API key decides the tenant, always. A
trusted gateway (`trust_client_headers`) can only narrow it, never leave it:

    tenants ─▶ the key's digest names the tenant (else 401)
               ├─ gateway's X-Client-Id: a sub-client, charged as "<tenant>/<id>"
               ├─ gateway's X-Client-Weight: lowers the tenant's weight, never raises it
               └─ gateway's X-Priority (or body `priority`): lowers the tenant's band (a
                  larger value), never raises it
    none    ─▶ gateway's X-Client-Id (and X-Client-Weight), as named
               else the body's `user` ...... "user:<pseudonym>"
               else the API key ............ "key:<pseudonym>" (Bearer, or X-Api-Key)
               else ........................ "anonymous"

Without tenants, a gateway's X-Priority (or the body's `priority`) sets the band, default 0.
Without `trust_client_headers` the headers and the body's `priority` are ignored. A pseudonym
is 12 hex digits of a salted HMAC-SHA256: the policies still tell every key and user apart,
and no metric label, log line or record holds any part of a key, nor a user's name. The salt
is random per process unless configured; replicas of one `fairway serve` get their parent's,
so they name alike.

Metric labels are bounded besides (`metric_labels`): tenants, and the clients `client_labels`
names, by name; a count of others by pseudonym, first come; everyone else as "other".
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from collections.abc import Callable

from aiohttp import web

from router.proxy.errors import APIError, bad_request
from router.proxy.settings import (
    MAX_CLIENT_ID,
    MAX_PRIORITY,
    MAX_WEIGHT,
    MIN_PRIORITY,
    MIN_WEIGHT,
    ProxySettings,
    Tenant,
    key_digest,
)

PRIORITY_TEXT = re.compile(r"-?[0-9]{1,9}")
PSEUDONYM_HEX = 12  # 48 bits: a collision merges two clients' accounting, nothing worse
ANONYMOUS = "anonymous"


def pseudonym(salt: bytes, kind: str, value: str) -> str:
    """`value` (a key, a user, a name) as `kind` sees it: the same value, the same pseudonym;
    nothing of the value shows."""
    message = f"{kind}:{value}".encode("utf-8", "surrogateescape")
    return hmac.new(salt, message, hashlib.sha256).hexdigest()[:PSEUDONYM_HEX]


def authenticate(http: web.Request, s: ProxySettings) -> Tenant | None:
    """The tenant of the request's API key when tenants are configured (else None); an
    unknown or missing key is a 401. Looked up by digest: see `key_digest`."""
    if not s.tenants:
        return None
    tenant = s.tenants.get(key_digest(bearer(http) or ""))
    if tenant is None:
        raise APIError(
            401, "Incorrect API key provided.", "invalid_request_error", code="invalid_api_key"
        )
    return tenant


def client_identity(
    http: web.Request, body: dict, tenant: Tenant | None, s: ProxySettings
) -> tuple[str, float]:
    """Who to be fair to, and with what weight (the rules above)."""
    if tenant is not None:
        client, weight = tenant.client, tenant.weight
        if s.trust_client_headers:
            if sub := http.headers.get("X-Client-Id"):
                client = f"{tenant.client}/{_client_name(sub, 'X-Client-Id')}"
            if (w := http.headers.get("X-Client-Weight")) is not None:
                weight = min(weight, _weight(w))
        return client, weight
    weight = 1.0
    if s.trust_client_headers:
        if (w := http.headers.get("X-Client-Weight")) is not None:
            weight = _weight(w)
        if cid := http.headers.get("X-Client-Id"):
            return _client_name(cid, "X-Client-Id"), weight
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string", "user")
    if user:
        return "user:" + pseudonym(s.client_salt, "user", _client_name(user, "user")), weight
    if key := bearer(http):
        return "key:" + pseudonym(s.client_salt, "key", key), weight
    return ANONYMOUS, weight


def client_priority(http: web.Request, body: dict, tenant: Tenant | None, s: ProxySettings) -> int:
    """The request's priority band (lower first, as vLLM): the tenant's; a trusted gateway's
    X-Priority, else the body's `priority`, may lower it (a larger value), never raise it.
    Without tenants, that value itself (default 0). Untrusted, both are ignored."""
    base = tenant.priority if tenant is not None else 0
    if not s.trust_client_headers:
        return base
    if (header := http.headers.get("X-Priority")) is not None:
        asked = _priority(_integer_text(header), "X-Priority")
    elif (field := body.get("priority")) is not None:
        asked = _priority(field, "priority")
    else:
        return base
    return max(base, asked) if tenant is not None else asked


def check_admin(http: web.Request, token: str | None) -> None:
    """403 while the admin API is off (no token), 401 without the token. Compared in constant
    time, digests of both, so neither the token's characters nor its length leak by timing."""
    if not token:
        raise APIError(403, "admin API disabled: no admin token configured", "permission_error")
    presented = http.headers.get("Authorization", "")
    if not hmac.compare_digest(key_digest(presented), key_digest(f"Bearer {token}")):
        raise APIError(401, "admin token required", "authentication_error")


def bearer(http: web.Request) -> str | None:
    """The caller's API key: OpenAI's clients send `Authorization: Bearer KEY`, Anthropic's
    `X-Api-Key: KEY`. The Authorization header wins when both are sent."""
    auth = http.headers.get("Authorization", "")
    if auth.startswith("Bearer ") and len(auth) > 7:
        return auth[7:]
    return http.headers.get("X-Api-Key") or None


def metric_labels(
    s: ProxySettings,
) -> tuple[list[str], int, dict[str, str], Callable[[str], str]]:
    """`RouterMetrics.label_clients`'s arguments for these settings: the tenants; the clients
    `client_labels` names (a gateway's name as it is, a `user` through its pseudonym), or a
    count of others, each under a pseudonym."""
    named: dict[str, str] = {}
    if isinstance(s.client_labels, int):
        top = s.client_labels
    else:
        top = 0
        for name in s.client_labels:
            named[name] = name
            named["user:" + pseudonym(s.client_salt, "user", name)] = name
    return [t.client for t in s.tenants.values()], top, named, _hider(s.client_salt)


def _hider(salt: bytes) -> Callable[[str], str]:
    def hide(client: str) -> str:
        kind, sep, rest = client.partition(":")
        if sep and kind in ("user", "key") and _is_pseudonym(rest):
            return client  # one already, as requests.csv has it
        return "id:" + pseudonym(salt, "id", client)

    return hide


def _is_pseudonym(text: str) -> bool:
    return len(text) == PSEUDONYM_HEX and all(c in "0123456789abcdef" for c in text)


def _client_name(name: str, param: str) -> str:
    if len(name) > MAX_CLIENT_ID or not name.isprintable():
        raise bad_request(f"{param} must be at most {MAX_CLIENT_ID} printable characters", param)
    return name


def _weight(text: str) -> float:
    try:
        w = float(text)
    except ValueError:
        raise bad_request("X-Client-Weight must be a number", "X-Client-Weight") from None
    if not (math.isfinite(w) and MIN_WEIGHT <= w <= MAX_WEIGHT):
        raise bad_request(
            f"X-Client-Weight must be between {MIN_WEIGHT:g} and {MAX_WEIGHT:g}",
            "X-Client-Weight",
        )
    return w


def _integer_text(text: str) -> int | str:
    """A header's integer, written plainly (not with `+`, `_`, spaces or non-ASCII digits,
    which int() would take); else the text, for `_priority` to refuse."""
    return int(text) if PRIORITY_TEXT.fullmatch(text) else text


def _priority(value: object, param: str) -> int:
    """An integer within [MIN_PRIORITY, MAX_PRIORITY]: each value is a band in every queue."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_request(f"{param} must be an integer", param)
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise bad_request(f"{param} must be between {MIN_PRIORITY} and {MAX_PRIORITY}", param)
    return value
