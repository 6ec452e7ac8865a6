"""The files of a proxy's recording (router/proxy/capture.py writes them, `load_recording` reads
them): the current `trace.jsonl` and its rotated parts `trace.N.jsonl`, oldest first."""

from __future__ import annotations

import re
from pathlib import Path

TRACE_FILE = "trace.jsonl"
PART = re.compile(r"^trace\.(\d+)\.jsonl$")


def recorded_parts(folder: Path) -> list[Path]:
    """The rotated parts of a recording, oldest first (the current trace.jsonl not included)."""
    parts = [(int(m[1]), folder / m[0]) for m in map(PART.match, names_in(folder)) if m]
    return [p for _, p in sorted(parts)]


def names_in(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir()] if folder.is_dir() else []
