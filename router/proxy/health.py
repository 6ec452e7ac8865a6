"""/health: whether this proxy can serve, and whether it serves as well as it should.

    200 {"status": "ok", ...} ........ at least one healthy worker, nothing degraded
    200 {"status": "degraded", ...} .. serving, but something it relies on is away (a router
                                        replica out of sync with the others' store; Ray's GCS
                                        gone, the proxy within its grace before it stops):
                                        the notes say what; a load balancer keeps sending to it
    503 {"status": "unavailable"} .... no healthy worker

What can degrade the proxy registers a note (HEALTH_NOTES): a function giving a sentence while
it is degraded, None while it is not; and exports the same as fairway_degraded{cause}
(RouterMetrics.watch_degraded).
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from router.proxy.forward import CLUSTER

HEALTH_NOTES = web.AppKey("health_notes", list[Callable[[], str | None]])


async def health(request: web.Request) -> web.Response:
    cluster = request.app[CLUSTER]
    healthy = len(cluster.healthy())
    notes = [n for note in request.app.get(HEALTH_NOTES, ()) if (n := note()) is not None]
    status = "unavailable" if not healthy else "degraded" if notes else "ok"
    body: dict[str, object] = {
        "status": status,
        "healthy_workers": healthy,
        "workers": len(cluster.workers),
    }
    if notes:
        body["degraded"] = notes
    return web.json_response(body, status=200 if healthy else 503)
