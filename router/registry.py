"""Name -> factory registries that feed the command line's choices."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from pydantic import TypeAdapter, ValidationError

T = TypeVar("T")


def call_with_params(factory: Callable[..., T], params: Mapping[str, object], what: str) -> T:
    """Call `factory` with user-given parameters (from the command line or a config file),
    each checked against the factory's annotation; an error names the parameter."""
    try:
        accepted = inspect.signature(factory, eval_str=True).parameters
    except NameError:  # an annotation only a type checker can resolve: pass values as given
        accepted = inspect.signature(factory).parameters
    unknown = set(params) - set(accepted)
    if unknown:
        raise ValueError(
            f"{what} takes no parameter {sorted(unknown)}; it "
            f"takes {sorted(p for p in accepted if p != 'seed')}"
        )
    checked: dict[str, Any] = {}
    for key, value in params.items():
        annotation = accepted[key].annotation
        if annotation is inspect.Parameter.empty or isinstance(annotation, str):
            checked[key] = value
            continue
        try:
            checked[key] = TypeAdapter(annotation).validate_python(value)
        except ValidationError as e:
            problem = e.errors()[0]["msg"]
            raise ValueError(f"{what}: parameter {key!r}={value!r}: {problem}") from None
    return factory(**checked)


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
        if "seed" in inspect.signature(factory).parameters and "seed" not in params:
            params = {**params, "seed": seed}
        return call_with_params(factory, params, f"{self.kind} {name!r}")

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __contains__(self, name: str) -> bool:
        return name in self._factories


global_policies: Registry = Registry("global policy")
local_policies: Registry = Registry("local policy")
