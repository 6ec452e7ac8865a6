"""Starting local server processes and waiting for them: one place for what the proxy (Redis),
the worker pool, the benches and the tests all need."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

GUARD = Path(__file__).with_name("guard.py")


def guarded(argv: list[str], owner: int | None = None) -> list[str]:
    """`argv` run through router/runtime/guard.py: the whole server (its process group) ends
    when `owner` (this process) dies, is told to stop, or the server's front process exits."""
    return [sys.executable, str(GUARD), str(owner or os.getpid()), "--", *argv]


def wait_healthy(url: str, timeout: float = 60.0) -> None:
    """Return once `url`/health answers 200; TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=1) as r:
            if r.status == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


@contextlib.contextmanager
def process(
    argv: list[str], core: int | None, log: Path, env: dict | None = None
) -> Iterator[subprocess.Popen]:
    """`argv` in a session of its own (pinned to `core` if given), its output in `log`;
    terminated (then killed) when the block ends."""
    if core is not None and shutil.which("taskset"):
        argv = ["taskset", "-c", str(core), *argv]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()  # reaped: no zombie left behind


def cpu_seconds(pid: int, children: bool = True) -> float:
    """CPU time (user + system, every thread) `pid` has used so far, and with `children` that
    of its descendants still running (Linux /proc; 0.0 for a process already gone). The benches
    divide work by it: streams per CPU-second of the router, apart from the load generator's."""
    pids = [pid, *(_descendants(pid) if children else [])]
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out
