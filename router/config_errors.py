"""One wording for what is wrong with a config file (cluster.yaml, fleet.yaml, a topology):

    cluster.yaml: workers.count: no servers to start (...); policy.name: unknown policy 'x'; ...

Each error is the field's path as the user wrote it, then what is wrong with it:
- a validator's own words, without pydantic's `Value error, ` before them;
- a check across a model's fields names the field it blames (FieldError), as a check of that
  field alone would, or names the fields in its message (`admin_port: ...`);
- where a field may take several forms (`client_labels: 20` or a list of names), pydantic puts
  the form it tried in the path (`client_labels.constrained-int`); the user wrote no such key,
  so it is left out.
Never the input: it may be a secret (an API key).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Annotated, Any, TypeVar, Union, cast, get_args, get_origin

from pydantic import BaseModel, PydanticUserError, TypeAdapter, ValidationError
from pydantic_core import ErrorDetails

M = TypeVar("M", bound=BaseModel)


class FieldError(ValueError):
    """A check across a model's fields, blamed on one of them: named `model.field` in the
    error, as a check of that field alone would be."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def validated(model: type[M], raw: object, source: str) -> M:
    """`model` from `raw` (a file's parsed text); a ValueError naming `source` and, for each
    error, the field and what is wrong with it."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        lines = [error_line(err, model) for err in e.errors()]
        raise ValueError(f"{source}: " + "; ".join(lines)) from None


def error_line(err: ErrorDetails, model: type[BaseModel]) -> str:
    """`groups.1.gpu: unknown 'h900'; ...`: one of `model`'s validation errors."""
    path = field_path(err["loc"], model)
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        path.append(cause.field)
    message = str(cause) if isinstance(cause, Exception) else err["msg"]
    return f"{'.'.join(path)}: {message}" if path else message


def field_path(loc: Sequence[int | str], model: type[BaseModel]) -> list[str]:
    """`loc` walked along `model`'s fields, with the forms pydantic tried in a union left out."""
    path: list[str] = []
    kind: object = model
    for part in loc:
        kind, members = _forms(kind)
        if len(members) > 1:  # `part` names the form tried: pydantic's name, not a key in the file
            kind = next((m for m in members if _tag(m) == part), None)
            continue
        path.append(str(part))
        kind = _inside(kind, part)
    return path


def _forms(kind: object) -> tuple[object, tuple[object, ...]]:
    """`kind` without Annotated's metadata, and its forms: those of a union, None apart (`X |
    None` is X, which may be null)."""
    if get_origin(kind) is Annotated:
        kind = get_args(kind)[0]
    if get_origin(kind) not in (Union, types.UnionType):
        return kind, (kind,)
    members = tuple(m for m in get_args(kind) if m is not type(None))
    return (members[0] if len(members) == 1 else kind), members


def _inside(kind: object, part: int | str) -> object:
    """The type at `part` of a value of type `kind` (None where not known)."""
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        fields = kind.model_fields
        field = fields.get(str(part)) or next((f for f in fields.values() if f.alias == part), None)
        return None if field is None else field.annotation
    args = get_args(kind)
    if get_origin(kind) is tuple:  # tuple[X, ...]: X; tuple[A, B]: by position
        if args[-1:] == (Ellipsis,):
            return args[0]
        return args[part] if isinstance(part, int) and part < len(args) else None
    return args[-1] if args else None  # list[X], set[X]: X; dict[K, V]: V


def _tag(kind: object) -> str | None:
    """The name pydantic gives a union's form in an error's path (`constrained-int`)."""
    try:
        return TypeAdapter(cast(Any, kind)).validator.title
    except PydanticUserError:  # a form pydantic cannot build alone
        return None
