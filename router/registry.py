"""Name -> factory registries that feed the command line's choices."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from pydantic import TypeAdapter, ValidationError

T = TypeVar("T")


def call_with_params(factory: Callable[..., T], params: Mapping[str, object], what: str) -> T:
    """Call `factory` with user-given parameters (from the command line or a config file),
    each checked against the factory's annotation; an error names the parameter."""
    accepted = user_parameters(factory)
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
    return factory(**gather(factory, checked))


def user_parameters(factory: Callable[..., object]) -> dict[str, inspect.Parameter]:
    """The parameters a user names for `factory`: its own, where one whose annotation is a
    dataclass (a parameters object several policies share) stands for its fields."""
    out: dict[str, inspect.Parameter] = {}
    for name, parameter in _signature(factory).items():
        group = _group_of(parameter)
        if group is None:
            out[name] = parameter
            continue
        hints = typing.get_type_hints(group)
        for field in dataclasses.fields(group):
            out[field.name] = inspect.Parameter(
                field.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[field.name]
            )
    return out


def gather(factory: Callable[..., object], params: Mapping[str, object]) -> dict[str, object]:
    """`params` by user names, as `factory` takes them: the fields of a parameters object
    gathered into one. A parameters object given whole is passed as it is."""
    out = dict(params)
    for name, parameter in _signature(factory).items():
        group = _group_of(parameter)
        if group is None or name in out:
            continue
        fields = {f.name: out.pop(f.name) for f in dataclasses.fields(group) if f.name in out}
        if fields:
            out[name] = group(**fields)
    return out


@functools.cache  # a fleet builds a local policy per worker: inspecting once is enough
def _signature(factory: Callable[..., object]) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(factory, eval_str=True).parameters
    except NameError:  # an annotation only a type checker can resolve: pass values as given
        return inspect.signature(factory).parameters


def _group_of(parameter: inspect.Parameter) -> type | None:
    """The parameters object `parameter` takes, if it takes one."""
    annotation = parameter.annotation
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return annotation
    return None


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
        """Create with parameters as users name them (a parameters object's fields apart, or
        the object whole), unchecked."""
        factory = self.get(name)
        return factory(**gather(factory, params))

    def build(self, name: str, params: Mapping[str, object], seed: int = 0) -> T:
        """Create from user-given parameters, naming any it does not take; a factory with a
        `seed` parameter gets `seed` unless the user set one."""
        factory = self.get(name)
        if "seed" in _signature(factory) and "seed" not in params:
            params = {**params, "seed": seed}
        return call_with_params(factory, params, f"{self.kind} {name!r}")

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __contains__(self, name: str) -> bool:
        return name in self._factories


global_policies: Registry = Registry("global policy")
local_policies: Registry = Registry("local policy")
