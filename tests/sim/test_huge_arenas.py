"""Python's small objects on huge pages (router/runtime/arenas.py, router/runtime/huge_arenas.c):
pymalloc's arenas come from 2 MiB-aligned reservations advised for huge pages, freed arenas go
back to the system, and a simulation's results do not change. Each check runs in a process of
its own: the allocator is installed for good."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from router.runtime import native
from router.runtime.arenas import OFF

SAMPLE = Path(__file__).resolve().parents[2] / "traces/samples/mooncake_conversation_head1000.jsonl"

pytestmark = [
    pytest.mark.slow,  # processes of their own
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's"),
]

# Fill the heap with small objects past one reservation (64 MiB), then free them: the memory
# must go back to the system, as with pymalloc's own arenas, and the reservations be in the
# process's map, 2 MiB-aligned, advised for huge pages ("hg").
ARENAS = """
import json, re
from router.runtime.arenas import reserved_bytes, use_huge_page_arenas
installed = use_huge_page_arenas()
def resident():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) << 10 for l in status if l.startswith("VmRSS:"))
before = resident()
held = [(i, i + 1) for i in range(1_500_000)]  # ~100 MiB of tuples and ints
checksum = sum(a + b for a, b in held)
full = resident()
advised = []
with open("/proc/self/smaps") as smaps:
    start = None
    for line in smaps:
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            start, end = (int(x, 16) for x in head.groups())
        elif line.startswith("VmFlags:") and " hg" in line:
            advised.append((start, end - start))
del held
print(json.dumps({"installed": installed, "reserved": reserved_bytes(), "advised": advised,
                  "grown": full - before, "kept": resident() - before, "checksum": checksum}))
"""


def run(code: str, *args: str, huge_pages: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != OFF}
    if not huge_pages:
        env[OFF] = "0"
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_arenas_come_from_aligned_advised_reservations_and_go_back() -> None:
    if native.native_root() is None:
        pytest.skip("the allocator is built with the compiled modules")
    got = json.loads(run(ARENAS).stdout)
    assert got["installed"]
    assert got["checksum"] == sum(2 * i + 1 for i in range(1_500_000))
    assert got["reserved"] >= 2 * 64 << 20, "100 MiB of small objects spans two reservations"
    if Path("/sys/kernel/mm/transparent_hugepage").exists():  # else the advice is refused
        reservations = [(start, size) for start, size in got["advised"] if size >= 32 << 20]
        assert reservations, "the reservations are advised for huge pages"
        assert all(start % (2 << 20) == 0 for start, _ in reservations)
    assert got["grown"] > 80 << 20
    assert got["kept"] < got["grown"] / 4, "freed arenas are unmapped, not kept"


def test_turned_off_it_leaves_pymalloc_as_it_was() -> None:
    got = json.loads(run(ARENAS, huge_pages=False).stdout)
    assert not got["installed"] and got["reserved"] == 0
    assert not [size for _, size in got["advised"] if size >= 32 << 20]


def test_a_simulation_is_the_same_on_either_pages(tmp_path: Path) -> None:
    """The command installs the allocator before it reads the trace; its rows and summary are
    the same as on pymalloc's own arenas."""
    outputs = []
    for huge_pages in (True, False):
        out = tmp_path / ("huge" if huge_pages else "small")
        argv = ["simulate", "--trace", str(SAMPLE), "--policy", "lpm", "--window", "0:20"]
        argv += ["--tile", "8", "--workers", "64", "--out", str(out)]
        run("from router.cli import main; raise SystemExit(main())", *argv, huge_pages=huge_pages)
        summary = json.loads((out / "summary.json").read_text())
        summary.pop("wall_seconds", None)
        summary.pop("cpu_seconds", None)
        outputs.append((summary, (out / "requests.csv").read_text()))
    assert outputs[0] == outputs[1]
    assert outputs[0][1].count("\n") > 500
