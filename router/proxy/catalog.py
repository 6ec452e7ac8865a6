"""What the proxy serves: each model group's name, tokenizer and LoRA adapters.

A request names a model as vLLM's API does: a base model by its served name, an adapter by its
own name. `resolve` turns that name into the group that must serve it (the Request's `model`,
in a fleet of several groups), the adapter if any, and the tokenizer its prompt is hashed with.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.proxy.errors import APIError
from router.proxy.prompts import PromptEncoder


@dataclass(frozen=True, slots=True)
class Served:
    name: str  # as requested
    base: str  # the base model's served name
    group: str | None  # the Request's model: `base` in a fleet of several groups, else None
    adapter: str | None
    encoder: PromptEncoder
    max_model_len: int


class Catalog:
    def __init__(self) -> None:
        self._served: dict[str, Served] = {}
        self.adapter_paths: dict[str, str] = {}  # adapter name -> its folder on the workers

    @classmethod
    def single(cls, name: str, encoder: PromptEncoder, max_model_len: int) -> Catalog:
        catalog = cls()
        catalog.add_group(name, encoder, max_model_len, several=False)
        return catalog

    def add_group(
        self,
        name: str,
        encoder: PromptEncoder,
        max_model_len: int,
        adapters: dict[str, str] | None = None,
        several: bool = True,
    ) -> None:
        """Serve model `name` and its `adapters` (name -> path). `several`: the fleet has more
        than one group, so the group is part of a request's routing and cache identity."""
        group = name if several else None
        self._add(Served(name, name, group, None, encoder, max_model_len))
        for adapter, path in (adapters or {}).items():
            self.add_adapter(name, adapter, path)

    def add_adapter(self, base: str, adapter: str, path: str) -> None:
        """Serve `adapter` (loaded from `path`) on model `base`'s workers."""
        model = self.resolve(base)
        self._add(Served(adapter, base, model.group, adapter, model.encoder, model.max_model_len))
        self.adapter_paths[adapter] = path

    def remove_adapter(self, adapter: str) -> bool:
        served = self._served.get(adapter)
        if served is None or served.adapter is None:
            return False
        del self._served[adapter]
        self.adapter_paths.pop(adapter, None)
        return True

    def resolve(self, name: str) -> Served:
        served = self._served.get(name)
        if served is None:
            message = f"The model `{name}` does not exist."
            raise APIError(404, message, "NotFoundError", "model", "model_not_found")
        return served

    def base_models(self) -> list[Served]:
        return [s for s in self._served.values() if s.adapter is None]

    def cards(self) -> list[dict]:
        """/v1/models' entries, as vLLM lists them: base models, then each one's adapters with
        it as their `parent`."""
        return [
            {
                "id": s.name,
                "object": "model",
                "owned_by": "fairway",
                "parent": None if s.adapter is None else s.base,
                "max_model_len": s.max_model_len,
            }
            for s in self._served.values()
        ]

    def _add(self, served: Served) -> None:
        if served.name in self._served:
            raise ValueError(f"the model name {served.name!r} is served twice")
        self._served[served.name] = served
