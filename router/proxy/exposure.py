"""What each listener serves. A proxy listens twice:

    public  host:port ............... the OpenAI API and /health (anyone who reaches it)
    admin   admin_host:admin_port ... all of it, and /metrics and /admin/* (loopback by default)

One app serves both: `public_scope` answers /metrics and /admin/* with a 404 unless the
connection came in on the admin port, so the rule holds however the app is served. Router
replicas listen on the shared port and each on an admin port of its own.
"""

from __future__ import annotations

import socket

from aiohttp import web

from router.proxy.errors import APIError


def is_admin_path(request: web.Request) -> bool:
    """Judged by the route aiohttp matched, not by the raw path: `/%6detrics` is /metrics."""
    resource = request.match_info.route.resource
    path = resource.canonical if resource is not None else ""
    return path == "/metrics" or path.startswith("/admin/")


def on_admin_listener(request: web.Request, admin_port: int | None) -> bool:
    """Whether the request's connection came in on the admin port (a connection's local port
    is its listener's). Anything else, or nothing to tell by, is public."""
    if admin_port is None or request.transport is None:
        return False
    local = request.transport.get_extra_info("sockname")
    return isinstance(local, tuple) and len(local) >= 2 and local[1] == admin_port


def public_scope(admin_port: int | None):
    """The middleware that keeps /metrics and /admin/* off every listener but the admin one."""

    @web.middleware
    async def scope(request: web.Request, handler) -> web.StreamResponse:
        if is_admin_path(request) and not on_admin_listener(request, admin_port):
            raise APIError.of_status(404, "Not Found: no such endpoint")
        return await handler(request)

    return scope


def admin_socket(host: str, port: int) -> socket.socket:
    """The admin listener's socket, bound and listening, for `web.run_app(sock=...)`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=128)
