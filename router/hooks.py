"""Running a policy's hooks: a faulty one stops a simulation, and only itself live.

A policy is user code, called from every step of the routing sequence. In a simulation (a strict
config) a hook that raises is a bug to see at once, so it propagates. Live, one request's hook
must not take the request down, nor the proxy: it is logged, counted, and the sequence goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class Hooks:
    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.errors = 0  # hooks that raised (live)

    def run(self, hook: Callable[..., object], *args: object) -> None:
        try:
            hook(*args)
        except Exception:
            if self.strict:
                raise
            self.errors += 1
            log.exception("policy hook %s failed", getattr(hook, "__qualname__", hook))
