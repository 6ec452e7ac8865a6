"""Run a server so that all of it dies with whoever started it.

    python workers/guard.py OWNER_PID -- ARGV...

Started in a session of its own, this process runs ARGV as its child, in its process group,
and ends that whole group (SIGTERM, then SIGKILL after a grace) when its owner dies (the kernel
sends it SIGTERM: PR_SET_PDEATHSIG), when it is sent SIGTERM or SIGINT, or when the server
exits by itself. The group matters: vLLM's engine core and workers are processes of their own
that outlive a front process ended alone. Should this guard be SIGKILLed (Ray kills a dead
actor's children so), the server gets SIGTERM from the kernel and ends its own processes.
Standard library only; Linux for the death signals.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE = 10.0  # seconds between SIGTERM and SIGKILL to what is left of the group
PR_SET_PDEATHSIG = 1


def others_in_group() -> list[int]:
    """Live members of this process's group besides itself (zombies are already ended)."""
    group, me, found = os.getpgrp(), os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        if pid != me and int(fields[2]) == group and fields[0] != "Z":
            found.append(pid)
    return found


def dies_with(guard: int):
    """For the server's fork: SIGTERM when this guard dies. Ray SIGKILLs a dead actor's
    children, this guard among them, before it can end the group; the server still goes."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded before the fork, not in it

    def preexec() -> None:
        if sys.platform.startswith("linux"):
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != guard:
            os._exit(1)

    return preexec


def end_group(server: subprocess.Popen) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + GRACE
    while time.monotonic() < deadline:
        server.poll()  # reap our child, so it does not count as alive
        if not others_in_group():
            return
        time.sleep(0.1)
    os.killpg(0, signal.SIGKILL)  # this process too: nothing is left to do


def main(argv: list[str]) -> int:
    owner, sep, command = int(argv[1]), argv[2], argv[3:]
    assert sep == "--" and command, "usage: guard.py OWNER_PID -- ARGV..."
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != owner:  # the owner died before the kernel could watch it for us
        return 1
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)  # a group of our own: ending it must not reach our caller's
    stopped: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stopped.append(signum))
    server = subprocess.Popen(command, preexec_fn=dies_with(os.getpid()))
    while server.poll() is None and not stopped:
        time.sleep(0.2)
    end_group(server)
    if stopped:
        return 128 + stopped[0]
    return server.returncode if server.returncode >= 0 else 128 - server.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv))
