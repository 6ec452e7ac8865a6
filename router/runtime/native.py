"""Compiled builds (mypyc) of the modules a simulation spends its time in.

The same source, compiled to C by mypyc: the request every layer shares, the engine, its block
manager, the cost model, the simulator's driver and its environment's queue of calls, the
cluster view and the load floors read from it (with their heap of (time, worker) pairs), the
dispatch queues, the prefix index, the router core, the hit bound every run reports and the
fairness policies' service meter. `make` builds them into build/native
(`router.runtime.native.main`), with C extensions beside them (EXTENSIONS: the huge-page
arena allocator, router/runtime/arenas.py, and the block manager's store of cached blocks,
simulator/cached_blocks.py), and the `router`, `simulator` and `policies` packages put that
folder first on their import path only while it was built from the very source on disk, for
this Python: edit a module and it runs as plain Python until the next build, never stale. Set
FAIRWAY_PURE=1 to run it all as plain Python (cProfile sees no frames inside compiled code).

A compiled class accepts no attribute it does not declare, and an interpreted subclass only if
it says so (`mypyc_attr(allow_interpreted_subclasses=True)`: the driver's SimCluster and the
router core's Router, which tests and benches extend). The policies themselves, which users
write, stay interpreted.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "build" / "native"
MODULES = (
    "router/request.py",
    "router/view.py",
    "simulator/time_heap.py",
    "simulator/environment.py",
    "simulator/load_floors.py",
    "router/core.py",
    "router/roster.py",
    "router/progress.py",
    "router/handoff.py",
    "router/decode.py",
    "router/replication.py",
    "router/hooks.py",
    "router/flight.py",
    "router/indexes.py",
    "router/latency.py",
    "router/load.py",
    "router/pools.py",
    "router/dispatch.py",
    "router/prefix_index.py",
    "policies/service_cost.py",
    "simulator/block_manager.py",
    "router/cost_model.py",
    "simulator/engine.py",
    "simulator/transfers.py",
    "simulator/hit_bound.py",
    "simulator/driver.py",
)
# C extensions built beside them, by name (each lands in the shared folder, a top-level module).
EXTENSIONS = {
    "fairway_huge_arenas": "router/runtime/huge_arenas.c",
    "fairway_cached_blocks": "simulator/cached_blocks.c",
}
SOURCES = (*MODULES, *EXTENSIONS.values())
STAMP = "sources.json"
# mypyc's shared library is a top-level module, so its folder goes on sys.path; a folder of its
# own, since build/native's package folders there would shadow the real packages (an import
# finds a namespace package on sys.path before the editable install's finder looks).
SHARED = "shared"
LAYOUT = 3  # of build/native: a build of another layout is not used


def rebuilt(frozen: Any) -> tuple[type, tuple]:
    """`__reduce__` for a frozen dataclass in a compiled module: compiled, one cannot be
    unpickled field by field (configs and cost models cross to worker processes and Ray
    tasks), so it is rebuilt through its constructor."""
    return type(frozen), tuple(getattr(frozen, f.name) for f in dataclasses.fields(frozen))


def fingerprint(root: Path = ROOT) -> dict[str, object]:
    """What a build must match to be used: the interpreter and every compiled source's hash;
    each source's size and modification time too, so that a check at import needs only stats."""
    sources = {m: hashlib.sha256((root / m).read_bytes()).hexdigest() for m in SOURCES}
    return {
        "python": sys.implementation.cache_tag,
        "layout": LAYOUT,
        "sources": sources,
        "stats": {m: _stat(root / m) for m in SOURCES},
    }


def _stat(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


@functools.cache
def native_root() -> Path | None:
    """build/native if it holds a build of the source on disk for this Python (and
    FAIRWAY_PURE is not set); else None. Checked once per process."""
    if os.environ.get("FAIRWAY_PURE") or not up_to_date():
        return None
    return NATIVE


def up_to_date(root: Path = ROOT, native: Path = NATIVE) -> bool:
    """Whether `native` holds a build of the sources under `root` for this Python: a stat per
    source, and a hash only of a source whose size or time moved (a checkout touches files
    without changing them)."""
    try:
        stamp = json.loads((native / STAMP).read_text())
        if (stamp.get("python"), stamp.get("layout")) != (sys.implementation.cache_tag, LAYOUT):
            return False
        return all(
            _stat(root / m) == stamp["stats"][m]
            or hashlib.sha256((root / m).read_bytes()).hexdigest() == stamp["sources"][m]
            for m in SOURCES
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False  # not built, or not run from a source checkout


def prefer_native(package_path: list[str], package: str) -> None:
    """Called by a package's __init__: look for its modules in the build first."""
    root = native_root()
    if root is None:
        return
    put_shared_on_path(root)
    package_path.insert(0, str(root / package))


def put_shared_on_path(root: Path) -> None:
    """Make the build's shared folder (mypyc's library, the C extensions) importable, once."""
    if str(root / SHARED) not in sys.path:
        sys.path.append(str(root / SHARED))


def is_native(module: object) -> bool:
    """Whether an imported module is the compiled one."""
    return str(getattr(module, "__file__", "")).endswith((".so", ".pyd"))


def build() -> Path:
    """Compile MODULES into build/native, replacing any earlier build by renames: a process
    importing meanwhile finds the old build, the new one or none (and runs plain Python), never
    half of one."""
    from mypyc.build import mypycify
    from setuptools import Distribution, Extension

    NATIVE.parent.mkdir(parents=True, exist_ok=True)
    # The sources as they are before mypyc reads them: one edited while it compiles makes the
    # build stale at once (the next check finds it changed), rather than stamping old code
    # with the new source's hash, used until the next edit.
    stamp = fingerprint(ROOT)
    work = Path(tempfile.mkdtemp(prefix="native-", dir=NATIVE.parent))
    cwd = Path.cwd()
    os.chdir(ROOT)  # mypyc names modules by their paths from here
    try:
        extensions = mypycify(
            [*MODULES, "--ignore-missing-imports"], opt_level="3", target_dir=str(work / "c")
        )
        extensions += [Extension(name, [source]) for name, source in EXTENSIONS.items()]
        dist = Distribution({"name": "fairway-native", "ext_modules": extensions})
        command = dist.get_command_obj("build_ext")
        command.build_lib = str(work / "lib")  # type: ignore[attr-defined]
        command.build_temp = str(work / "obj")  # type: ignore[attr-defined]
        dist.run_command("build_ext")
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)  # a failed build leaves no half-built folder
        raise
    finally:
        os.chdir(cwd)
    built = work / "lib"
    (built / SHARED).mkdir()
    libraries = [*built.glob("*__mypyc*"), *(p for n in EXTENSIONS for p in built.glob(n + ".*"))]
    for library in libraries:
        library.rename(built / SHARED / library.name)
    (built / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
    old = NATIVE.with_name("native-old")
    shutil.rmtree(old, ignore_errors=True)
    if NATIVE.exists():
        NATIVE.rename(old)
    built.rename(NATIVE)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    return NATIVE


def main() -> int:
    if up_to_date():
        print(f"{NATIVE}: up to date")
        return 0
    print(f"compiling {len(MODULES)} modules with mypyc and {len(EXTENSIONS)} in C into {build()}")
    return 0
