"""A simulated fleet of model groups: which workers serve which model, on what hardware.

    groups:
      - name: llama-8b          # what a request's `model` names
        workers: 6
        model: llama-3-8b       # the roofline's model preset (`fairway models`)
        gpu: a100-80g
        adapter_slots: 4        # LoRA adapters resident at once (vLLM's --max-loras)
        adapter_load_time: 0.2  # seconds the step that loads one takes longer
      - name: llama-70b
        workers: 2
        model: llama-3-70b
        gpu: h100
        tp: 4                   # or `profile: FILE.json`, a fitted cost (`fairway profile`)

Each group's engines run its own cost model (the one `fairway simulate --model/--gpu/--tp` or
`--cost` builds) and adapter slots. In a fleet of several groups a request must name its group
(router.request.Request.model); in a fleet of one, nothing filters and a request's model is
not read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.config_errors import validated
from router.cost_model import GPUS, MODELS, CostModel, FittedCost, roofline
from router.request import Request


class ModelGroup(BaseModel):
    """`workers` engines serving model group `name`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    workers: int = Field(gt=0)
    model: str = "llama-3-8b"
    gpu: str = "a100-80g"
    tp: int | None = Field(None, gt=0)  # None: the model's default
    profile: str | None = None  # a fitted cost JSON: replaces the model/gpu/tp roofline
    adapter_slots: int = Field(0, ge=0)  # 0: adapters not modelled
    adapter_load_time: float = Field(0.0, ge=0)

    @field_validator("model")
    @classmethod
    def _known_model(cls, v: str) -> str:
        return _one_of(v, MODELS)

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str) -> str:
        return _one_of(v, GPUS)

    @field_validator("profile")
    @classmethod
    def _readable_profile(cls, v: str | None) -> str | None:
        if v is not None:
            FittedCost.load(v)  # a bad file fails here, named by its field
        return v

    @model_validator(mode="after")
    def _fits(self) -> ModelGroup:
        if self.profile is None:
            self.cost()  # a model too big for tp x gpu fails here, named by its group
        return self

    def cost(self) -> CostModel:
        """The step-cost model of this group's engines."""
        if self.profile is not None:
            return FittedCost.load(self.profile)
        return roofline(self.model, self.gpu, self.tp)


class Fleet(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    groups: tuple[ModelGroup, ...] = Field(min_length=1)

    @field_validator("groups")
    @classmethod
    def _distinct_names(cls, v: tuple[ModelGroup, ...]) -> tuple[ModelGroup, ...]:
        names = [g.name for g in v]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"group names must differ: {', '.join(map(repr, twice))} twice")
        return v

    @property
    def num_workers(self) -> int:
        return sum(g.workers for g in self.groups)


def _one_of(value: str, known: Mapping[str, object]) -> str:
    if value not in known:
        raise ValueError(f"unknown {value!r}; choose one of: {', '.join(known)}")
    return value


def load_fleet(path: str | Path) -> Fleet:
    """A fleet from YAML (or JSON, which YAML reads); errors name the file and the field."""
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read the fleet: {e}") from None
    return parse_fleet(raw, source=str(path))


def parse_fleet(raw: object, source: str = "fleet") -> Fleet:
    return validated(Fleet, raw, source)


def check_requests(groups: Iterable[ModelGroup], requests: Iterable[Request]) -> None:
    """Before a run on several groups: every request names one of them (a ValueError names
    the first that does not). One group serves every request, whatever it names."""
    names = [g.name for g in groups]
    if len(names) < 2:
        return
    known = set(names)
    for r in requests:
        if r.model not in known:
            said = "names no model" if r.model is None else f"names model {r.model!r}"
            raise ValueError(
                f"request {r.id} {said}; this fleet's model groups are: {', '.join(names)}"
            )
