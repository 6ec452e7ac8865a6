"""Name -> factory registries that feed the command line's choices."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def decorate(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._factories[name] = factory
            factory.name = name  # type: ignore[attr-defined]
            return factory

        return decorate

    def get(self, name: str) -> Callable[..., T]:
        try:
            return self._factories[name]
        except KeyError:
            known = ", ".join(sorted(self._factories))
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of: {known}") from None

    def create(self, name: str, **params: object) -> T:
        return self.get(name)(**params)

    def build(self, name: str, params: Mapping[str, object], seed: int = 0) -> T:
        """Create from user-given parameters, naming any it does not take; a factory with a
        `seed` parameter gets `seed` unless the user set one."""
        factory = self.get(name)
        accepted = inspect.signature(factory).parameters
        unknown = set(params) - set(accepted)
        if unknown:
            raise ValueError(
                f"{self.kind} {name!r} takes no parameter {sorted(unknown)}; it "
                f"takes {sorted(p for p in accepted if p != 'seed')}"
            )
        if "seed" in accepted and "seed" not in params:
            params = {**params, "seed": seed}
        return factory(**params)

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __contains__(self, name: str) -> bool:
        return name in self._factories


global_policies: Registry = Registry("global policy")
local_policies: Registry = Registry("local policy")
