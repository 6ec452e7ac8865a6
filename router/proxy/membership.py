"""Who is in the pool: the admin API's adds and removes, checked.

    POST /admin/workers {"url", "kv_events",  ─▶ new_worker(): the URL http(s), a host, a port in
                         "model", "role"}        range; the model one the proxy serves; the role
                                              ─▶ Membership.add: 409 if the URL is in the pool
    DELETE /admin/workers?id=N                ─▶ Membership.remove: 404 if it is not

An added server is taken to be started as the others of its model group were: it gets their
adapter slots, priority scheduling and KV connector shape (`LiveCluster.add_worker_like_peers`).

`Membership` changes one proxy's own pool. Router replicas share theirs through the store
(router/proxy/service/shared_state.py, `SharedMembership`): there an add or a remove is an event
in a log every replica applies in the same order, so worker ids agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web

from router.prefix_index import WorkerId
from router.proxy.catalog import Catalog
from router.proxy.driver import LiveCluster, LiveWorker
from router.proxy.errors import APIError, bad_request
from router.traits import Role

DEFAULT_PORTS = {"http": 80, "https": 443}


def worker_url(value: object) -> str:
    """`value` as a worker's base URL in one spelling (scheme and host in lower case, no
    default port, no trailing slash), or a 400 saying what is wrong with it."""
    if not isinstance(value, str) or not value:
        raise bad_request("'url' must be a string: the worker's http(s) base URL", "url")
    if any(c.isspace() or not c.isprintable() for c in value):
        raise bad_request("'url' must not hold spaces or control characters", "url")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as e:  # a port out of range or not a number, a malformed IPv6 host
        raise bad_request(f"'url' {value!r}: {e}", "url") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise bad_request(f"'url' {value!r}: the scheme must be http or https", "url")
    if not parts.hostname:
        raise bad_request(f"'url' {value!r}: no host", "url")
    if port == 0:
        raise bad_request(f"'url' {value!r}: port 0 is not a port to reach", "url")
    if parts.username is not None or parts.password is not None:
        raise bad_request(f"'url' {value!r}: credentials do not belong in a worker URL", "url")
    if parts.query or parts.fragment:
        raise bad_request(f"'url' {value!r}: a base URL has no query or fragment", "url")
    host = parts.hostname.lower()
    host = f"[{host}]" if ":" in host else host
    netloc = host if port in (None, DEFAULT_PORTS[scheme]) else f"{host}:{port}"
    return f"{scheme}://{netloc}{parts.path.rstrip('/')}"


def kv_events_endpoint(value: object) -> str | None:
    if value is None or isinstance(value, str) and value:
        return value  # type: ignore[return-value]
    raise bad_request("'kv_events' must be a ZMQ endpoint (a string) or null", "kv_events")


@dataclass(frozen=True)
class NewWorker:
    """A server the admin API adds."""

    url: str  # as worker_url spells it
    kv_events: str | None = None
    model: str | None = None  # its model group, in a fleet of several
    role: Role = Role.MIXED


def new_worker(body: dict, catalog: Catalog) -> NewWorker:
    """The server a POST /admin/workers body describes, or a 400 naming the field."""
    role = body.get("role", Role.MIXED.value)
    if not isinstance(role, str) or role not in {r.value for r in Role}:
        raise bad_request("'role' must be mixed, prefill or decode", "role")
    return NewWorker(
        worker_url(body.get("url")),
        kv_events_endpoint(body.get("kv_events")),
        _model_group(body.get("model"), catalog),
        Role(role),
    )


def _model_group(value: object, catalog: Catalog) -> str | None:
    models = catalog.base_models()
    names = ", ".join(m.name for m in models)
    if value is None:
        if len(models) > 1:
            raise bad_request(f"'model' is required: the proxy serves {names}", "model")
        return None
    model = next((m for m in models if m.name == value), None)
    if model is None:
        shown = str(value)[:80]
        raise bad_request(f"'model' {shown!r} is none of the models served ({names})", "model")
    return model.group


def same_url(url: str) -> str:
    """The one spelling of `url`, or `url` itself if it is not one the admin API would take."""
    try:
        return worker_url(url)
    except APIError:
        return url.rstrip("/")


def duplicate(url: str, wid: WorkerId) -> APIError:
    return APIError(
        409, f"worker {url} is already in the pool (id {wid})", param="url", code="worker_exists"
    )


def missing(wid: WorkerId) -> APIError:
    return APIError(404, f"no worker {wid}", "not_found_error", "id")


class Membership:
    """One proxy's own pool, changed through the admin API."""

    version: int | None = None  # how many changes the pool has seen, where it is shared

    def __init__(self, cluster: LiveCluster) -> None:
        self.cluster = cluster

    async def add(self, new: NewWorker) -> LiveWorker:
        """Add the server; a 409 if its URL is in the pool."""
        for w in self.cluster.workers.values():
            if same_url(w.url) == new.url:
                raise duplicate(new.url, w.id)
        return self.cluster.add_worker_like_peers(new.url, new.kv_events, new.model, new.role)

    async def remove(self, wid: WorkerId) -> None:
        if wid not in self.cluster.workers:
            raise missing(wid)
        self.cluster.remove_worker(wid)


MEMBERSHIP = web.AppKey("membership", Membership)
