"""Running a policy's hooks: a faulty one stops a simulation, and only itself live.

A policy is user code, called from every step of the routing sequence. In a simulation (a strict
config) a hook that raises is a bug to see at once, so it propagates. Live, one request's hook
must not take the request down, nor the proxy: it is logged, counted (the proxy exports the count
as fairway_policy_hook_errors_total, by hook), and the sequence goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class Hooks:
    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.errors = 0  # hooks that raised (live)
        # Told each failed hook's name (its qualified name: code, never a request's data).
        self.on_error: Callable[[str], None] | None = None

    def run(self, hook: Callable[..., object], *args: object) -> None:
        try:
            hook(*args)
        except Exception:
            if self.strict:
                raise
            self.errors += 1
            name = str(getattr(hook, "__qualname__", type(hook).__qualname__))
            log.exception("policy hook %s failed", name)
            if self.on_error is not None:
                self.on_error(name)
