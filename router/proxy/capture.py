"""Live traffic as a replayable trace: the proxy's recording in Fairway's native format.

Each answered request becomes one line of `trace.jsonl` in the record folder: its arrival (seconds
since the proxy started), client, session where the caller named one, priority where not 0,
prompt length, output length (the tokens actually generated), the prompt's chained block hashes
at the workers' block size, and the worker and policy that served it. Never prompt text: the
hashes cannot be turned back into tokens, and a replay makes its own tokens from them
(traces/replay.py).

Files rotate: past `max_file_bytes` the current file becomes `trace.N.jsonl` and only the newest
`keep` of those stay, so a recording never takes more than (keep + 1) x max_file_bytes.
`fairway simulate --trace RECORD_DIR` replays all the parts kept, in order;
`--trace RECORD_DIR/trace.jsonl` the current one alone.
"""

from __future__ import annotations

import json
from pathlib import Path

from router.request import Request
from traces.recording import PART, TRACE_FILE, names_in, recorded_parts


class TraceCapture:
    def __init__(
        self,
        folder: str | Path,
        block_size: int,
        policy: str,
        max_file_bytes: int = 64 << 20,
        keep: int = 4,
        roles: list[str] | None = None,
    ) -> None:
        """`roles`: a split fleet's worker roles by id, in each file's header, so that a
        replay runs the same pools."""
        if max_file_bytes < 4096:
            raise ValueError(f"max_file_bytes: at least 4096, got {max_file_bytes}")
        if keep < 0:
            raise ValueError(f"keep: must be >= 0, got {keep}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.block_size, self.policy = block_size, policy
        self.max_file_bytes, self.keep = max_file_bytes, keep
        self.roles = roles
        self._next_part = (
            max((int(m[1]) for m in map(PART.match, names_in(self.folder)) if m), default=0) + 1
        )
        self._file = None
        self._size = 0
        self._open()

    def write(
        self,
        request: Request,
        arrival: float,
        output_tokens: int,
        worker: int,
        session: str | None = None,
        decode_worker: int | None = None,
    ) -> None:
        """`worker`: where routing placed it (a split request's prefill worker), and
        `decode_worker` where a split request decoded."""
        line = {
            "id": request.id,
            "arrival": round(max(arrival, 0.0), 6),
            "prompt_len": request.prompt_len,
            "output_len": max(output_tokens, 1),
            "block_hashes": request.block_hashes,
            "client": request.client,
            "worker": worker,
            "policy": self.policy,
        }
        if decode_worker is not None:
            line["decode_worker"] = decode_worker
        if session:
            line["session"] = session
        # The hashes carry the cache identity already (the header says `keyed`). The salt is not
        # written: it keeps one tenant's cache from being probed by another, a secret.
        if request.model is not None:
            line["model"] = request.model
        if request.adapter is not None:
            line["adapter"] = request.adapter
        if request.weight != 1.0:
            line["weight"] = request.weight
        if request.priority != 0:  # its band: a replay runs it in the same class
            line["priority"] = request.priority
        if request.api is not None:  # a replay sends it through the same API
            line["api"] = request.api
        text = json.dumps(line, separators=(",", ":")) + "\n"
        if self._size + len(text) > self.max_file_bytes and self._size > len(self._header()):
            self._rotate()
        assert self._file is not None
        self._file.write(text)
        self._file.flush()
        self._size += len(text)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _header(self) -> str:
        header: dict[str, object] = {
            "fairway_trace": 1,
            "block_size": self.block_size,
            "keyed": True,
        }
        if self.roles is not None:
            header["roles"] = self.roles
        return json.dumps(header) + "\n"

    def _open(self) -> None:
        path = self.folder / TRACE_FILE
        fresh = not path.exists() or path.stat().st_size == 0
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        if fresh:
            self._file.write(self._header())
            self._file.flush()
        self._size = path.stat().st_size

    def _rotate(self) -> None:
        self.close()
        (self.folder / TRACE_FILE).rename(self.folder / f"trace.{self._next_part}.jsonl")
        self._next_part += 1
        parts = recorded_parts(self.folder)
        for old in parts[: len(parts) - self.keep]:
            old.unlink()
        self._open()
