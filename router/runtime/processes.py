"""Starting local server processes and waiting for them: one place for what the proxy (Redis),
the worker pool, the benches and the tests all need."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator
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


async def wait_healthy_async(url: str, timeout: float = 60.0) -> None:
    """`wait_healthy` from inside an event loop, which keeps running meanwhile: the same polls,
    on a thread of their own (each ends within `timeout`, even if this await is cancelled)."""
    await asyncio.to_thread(wait_healthy, url, timeout)


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
        stop(proc, 10.0)


def stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM, then SIGKILL if `proc` is still there after `grace` seconds; reaped either way
    (no zombie left behind)."""
    stop_all([proc], grace)


def stop_all(procs: Iterable[subprocess.Popen], grace: float) -> None:
    """`stop` for several processes at once: all told first, so that together they take one
    `grace`, not one each."""
    procs = list(procs)
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first, then the parent's pid, ...,
    utime at 11, stime at 12, the start time at 19); None for a process that is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def cpu_seconds(pid: int, children: bool = True) -> float:
    """CPU time (user + system, every thread) `pid` has used so far, and with `children` that
    of its descendants still running (Linux /proc; 0.0 for a process already gone). The benches
    divide work by it: streams per CPU-second of the router, apart from the load generator's."""
    pids = [pid, *(_descendants(pid) if children else [])]
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in pids:
        if (fields := stat_fields(p)) is not None:
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := stat_fields(int(entry.name))) is not None:
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def memory_mib(field: str, pid: int | str = "self") -> float | None:
    """A process's memory figure from Linux's /proc status, in MiB: `VmRSS` (resident now) or
    `VmHWM` (its address space's peak: unlike the rusage peak, not carried over exec from the
    process that started it). None where there is no such file or field."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024  # kB
    return None
