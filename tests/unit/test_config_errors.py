"""A config file's errors, in one wording: the field as the user wrote it, then what is wrong."""

from __future__ import annotations

from typing import Annotated

import pytest
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.config_errors import FieldError, validated


class Server(BaseModel):
    model_config = ConfigDict(extra="forbid")

    port: int = Field(8000, gt=0)
    prefill: int = 0
    decode: int = 0

    @model_validator(mode="after")
    def _pairs(self) -> Server:
        if self.prefill and not self.decode:
            raise FieldError("decode", "prefill servers need decode servers")
        return self


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "x"
    servers: tuple[Server, ...] = ()
    labels: Annotated[int, Field(ge=0)] | list[Annotated[str, Field(min_length=1)]] = 0
    pools: dict[str, list[Server]] = {}
    secret: str | None = None

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v != "x":
            raise ValueError(f"unknown name {v!r}")
        return v


@pytest.mark.parametrize(
    "raw, error",
    [
        ({"name": "y"}, "name: unknown name 'y'"),
        ({"servers": [{}, {"port": 0}]}, "servers.1.port: Input should be greater than 0"),
        ({"servers": [{"prefill": 1}]}, "servers.0.decode: prefill servers need decode servers"),
        ({"labels": [""]}, "labels: Input should be a valid integer; labels.0: String should"),
        ({"labels": -1}, "labels: Input should be greater than or equal to 0; labels: Input"),
        ({"pools": {"a": [{"colour": 1}]}}, "pools.a.0.colour: Extra inputs are not permitted"),
        ({"secret": 5}, "secret: Input should be a valid string"),
        ([], "Input should be a valid dictionary"),
    ],
)  # fmt: skip
def test_each_error_names_the_field_as_written(raw: object, error: str) -> None:
    with pytest.raises(ValueError) as caught:
        validated(Config, raw, "c.yaml")
    assert str(caught.value).startswith(f"c.yaml: {error}"), str(caught.value)


def test_every_error_is_said_and_no_input_is() -> None:
    with pytest.raises(ValueError) as caught:
        validated(Config, {"name": "y", "secret": ["hunter3"], "colour": 1}, "c")
    text = str(caught.value)
    assert text.count(";") == 2 and "colour: Extra inputs" in text, text
    assert "hunter3" not in text, "an error never shows what was given"


def test_a_valid_config_is_returned() -> None:
    config = validated(Config, {"servers": [{"prefill": 1, "decode": 1}]}, "c")
    assert config.servers[0].decode == 1
