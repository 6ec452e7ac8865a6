"""What the proxy does while its workers' Ray cluster has lost its GCS: serve on, then stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from router.proxy.driver import LiveCluster

log = logging.getLogger("fairway.serve")


def shut_down(reason: str) -> None:
    """Stop as on SIGTERM: finish in-flight requests, then stop the servers."""
    log.error("%s: shutting down", reason)
    os.kill(os.getpid(), signal.SIGTERM)


class GcsGrace:
    """What the proxy does when its workers' Ray cluster loses its GCS (WorkerPool.watch tells
    it, and tells it again when the GCS answers). Without its GCS Ray takes its actors, and
    their servers, sooner or later (at once on the GCS's own node), so the proxy stops: but
    only after `grace` seconds, serving meanwhile on whatever workers still pass their health
    checks, and saying so (/health `degraded`, fairway_degraded{cause="ray_gcs"}). With no
    worker left healthy there is nothing to serve, and it stops at once. A GCS that answers
    again within the grace calls the stop off. Either way the reason is logged.

        answering ── lost(reason) ──▶ degraded ── `grace` s, or no worker healthy ──▶ stop
            ▲                            │                         (as on SIGTERM)
            └──────── lost(None) ────────┘
    """

    POLL = 0.25  # seconds between looks at the grace and the healthy workers

    def __init__(
        self,
        grace: float,
        stop: Callable[[str], None] = shut_down,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.grace, self.stop, self.clock = grace, stop, clock
        self.reason: str | None = None  # while the GCS is lost
        self.since = 0.0
        # Healthy workers, as the proxy's event loop last counted them (`watching`); None: not
        # counted (router replicas, whose parent holds this), and the grace runs whole.
        self.num_healthy: int | None = None
        self._called_off = threading.Event()  # the current loss's: set when the GCS is back
        self._lock = threading.Lock()

    def __call__(self, reason: str | None) -> None:
        """WorkerPool.watch's `on_lost`: the GCS is gone (why), or None: it answers again."""
        with self._lock:
            if reason is None:
                self._answers_again()
            elif self.reason is None:
                self._lost(reason)

    def _lost(self, reason: str) -> None:
        self.reason, self.since = reason, self.clock()
        if self.grace <= 0:
            self.stop(reason)
            return
        log.error(
            "%s: serving on the workers that still answer for %g s (ray_gcs_grace), then "
            "shutting down",
            reason,
            self.grace,
        )
        called_off = self._called_off = threading.Event()
        threading.Thread(
            target=self._serve_on, args=(reason, called_off), name="fairway-gcs-grace", daemon=True
        ).start()

    def _serve_on(self, reason: str, called_off: threading.Event) -> None:
        while not called_off.wait(self.POLL):
            if self.num_healthy == 0:
                why = f"{reason}, and no worker is left healthy to serve through the grace"
            elif self.clock() - self.since >= self.grace:
                why = f"{reason} for {self.grace:g} s (ray_gcs_grace)"
            else:
                continue
            with self._lock:
                if called_off.is_set():
                    return
            self.stop(why)
            return

    def _answers_again(self) -> None:
        if self.reason is None:
            return
        self._called_off.set()
        log.warning(
            "Ray's GCS answers again after %.1f s: not shutting down", self.clock() - self.since
        )
        self.reason = None

    def is_degraded(self) -> bool:
        return self.reason is not None

    def health_note(self) -> str | None:
        """Why the proxy is degraded (/health), or None while the GCS answers."""
        reason = self.reason
        if reason is None:
            return None
        left = max(0.0, self.grace - (self.clock() - self.since))
        return f"{reason}: serving on the workers that answer, shutting down in {left:.0f} s"

    def watching(self, cluster: LiveCluster) -> Callable[[web.Application], AsyncIterator[None]]:
        """An aiohttp cleanup context that counts the healthy workers for the grace, on the
        event loop that owns them, every POLL seconds while the app runs."""

        async def ctx(app: web.Application) -> AsyncIterator[None]:
            async def count() -> None:
                while True:
                    self.num_healthy = len(cluster.healthy())
                    await asyncio.sleep(self.POLL)

            task = asyncio.create_task(count(), name="fairway-gcs-grace")
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

        return ctx
