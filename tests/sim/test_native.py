"""The compiled build of the hot modules (router/runtime/native.py): in use under `make test`,
used only while it matches the source, and giving the same simulation as plain Python to the
last bit."""

from __future__ import annotations

import importlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from router.runtime import native

# Records of small runs that between them take every compiled path: the policies' reads of the
# view and index, fast-forwarded decode runs, preemptions (a small KV cache), the precise
# index's delayed events, the router's own queues, chunked prefill, a split fleet's KV transfers.
RUNS = """
import dataclasses, json, sys
from simulator.config import SimConfig
from simulator.driver import simulate
from router.cost_model import roofline
from simulator.engine import EngineConfig
from traces.generators import shared_prefix

trace = shared_prefix(num_requests=240, num_tenants=4, rate=40.0, seed=5)
cost = roofline("llama-3-8b", "a100-80g")
small = EngineConfig(num_kv_blocks=900, max_num_batched_tokens=512)
configs = [
    SimConfig(num_workers=4, policy=p, engine=small)
    for p in ("least_load", "lpm", "d2lpm", "vtc", "preble")
] + [
    SimConfig(num_workers=4, policy="lpm", index="precise", kv_event_delay=0.05),
    SimConfig(num_workers=4, policy="d2lpm", placement="router"),
    SimConfig(num_workers=4, policy="lpm", prefill_workers=1, decode_workers=3),
]
out = [[dataclasses.astuple(r) for r in simulate(trace, cost, c).records] for c in configs]
json.dump(out, sys.stdout)
"""


def run_records(pure: bool) -> list:
    env = {k: v for k, v in os.environ.items() if k != "FAIRWAY_PURE"}
    if pure:
        env["FAIRWAY_PURE"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", RUNS], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_make_built_what_the_tests_run() -> None:
    if os.environ.get("FAIRWAY_PURE"):
        pytest.skip("FAIRWAY_PURE is set: plain Python asked for")
    if not os.environ.get("FAIRWAY_REQUIRE_NATIVE"):
        pytest.skip("only `make test` builds first (make test-fast runs what is there)")
    assert native.native_root() is not None, (
        "build/native is missing or older than the source: `make test` rebuilds it"
    )
    for path in native.MODULES:
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        assert native.is_native(module), module.__file__
    from simulator import cached_blocks

    assert cached_blocks.new_store is not cached_blocks.CachedBlocks, "the C store is not used"


@pytest.mark.slow  # a process of its own
def test_compiled_and_plain_python_simulate_the_same() -> None:
    if native.native_root() is None:
        pytest.skip("no compiled build to compare")
    compiled, pure = run_records(pure=False), run_records(pure=True)
    assert len(compiled) == len(pure) == 8
    for a, b in zip(compiled, pure, strict=True):
        assert len(a) == 240
        # As written: a time Python kept as the int 0 is written "0", compiled "0.0".
        assert json.dumps(a) == json.dumps(b)


def test_a_build_is_used_only_for_the_source_it_was_built_from(tmp_path: Path) -> None:
    root, built = tmp_path / "src", tmp_path / "native"
    for path in native.SOURCES:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(native.ROOT / path, root / path)
    built.mkdir()
    assert not native.up_to_date(root, built), "no build yet"
    (built / native.STAMP).write_text(json.dumps(native.fingerprint(root)))
    assert native.up_to_date(root, built)
    touched = root / native.MODULES[0]
    os.utime(touched, ns=(0, touched.stat().st_mtime_ns + 10**9))
    assert native.up_to_date(root, built), "a source touched but unchanged keeps the build"
    edited = root / native.MODULES[-1]
    text = edited.read_text()
    edited.write_text(text[:-2] + ("x" if text[-2] != "x" else "y") + text[-1])
    os.utime(edited, ns=(0, edited.stat().st_mtime_ns + 2 * 10**9))  # coarse clocks: moved
    assert not native.up_to_date(root, built), "an edit of the same size is seen"
    edited.write_text(text + "\n# an edit\n")
    assert not native.up_to_date(root, built), "an edited source runs as plain Python"


def test_a_source_edited_while_it_compiles_leaves_the_build_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stamp is the source as the compiler read it, not as it is once the build ends."""
    root = tmp_path / "src"
    for path in native.SOURCES:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(native.ROOT / path, root / path)
    monkeypatch.setattr(native, "ROOT", root)
    monkeypatch.setattr(native, "NATIVE", tmp_path / "build" / "native")
    monkeypatch.setattr(native, "EXTENSIONS", {})
    edited = root / native.MODULES[0]

    def compile_while_editing(paths: list[str], **options: object) -> list[object]:
        Path(str(options["target_dir"])).parent.joinpath("lib").mkdir()  # what it would build
        edited.write_text(edited.read_text() + "\n# edited while compiling\n")
        return []

    monkeypatch.setattr("mypyc.build.mypycify", compile_while_editing)
    built = native.build()
    assert (built / native.STAMP).exists()
    assert not native.up_to_date(root, built), "the edit runs as plain Python until rebuilt"


@pytest.mark.slow  # a process of its own
def test_the_installed_command_finds_every_package_and_the_build(tmp_path: Path) -> None:
    """`fairway` (what `make demo` runs) imports the project through the editable install's
    finder, with no checkout on sys.path: the build's folders must not stand in for the
    packages (a folder on sys.path is found first, as a namespace package)."""
    if native.native_root() is None:
        pytest.skip("no compiled build in use")
    if sys.version_info < (3, 11):
        pytest.skip("python -P (no script folder on sys.path) is 3.11's")
    fairway = Path(sys.executable).with_name("fairway")
    if not fairway.exists():
        pytest.skip("not installed as a command here")
    done = subprocess.run(
        [str(fairway), "policies"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "d2lpm" in done.stdout and "least_load" in done.stdout
    code = (
        "import json, policies, simulator, simulator.engine, policies.service_cost\n"
        "from router.runtime import native\n"
        "print(json.dumps([hasattr(policies, 'global_policies'), simulator.__file__,\n"
        "    native.is_native(simulator.engine), native.is_native(policies.service_cost)]))"
    )
    done = subprocess.run(
        [sys.executable, "-P", "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    registered, simulator_init, engine_compiled, meter_compiled = json.loads(done.stdout)
    assert registered, "policies/__init__ did not run: a namespace package stood in for it"
    assert simulator_init == str(native.ROOT / "simulator" / "__init__.py")
    assert engine_compiled and meter_compiled


def test_configs_cross_process_boundaries() -> None:
    """`fairway experiment` and `compare` send configs to worker processes: compiled or not,
    they come back equal."""
    from simulator.config import SimConfig
    from simulator.engine import EngineConfig

    config = SimConfig(num_workers=3, engine=EngineConfig(num_kv_blocks=64, max_num_seqs=8))
    assert pickle.loads(pickle.dumps(config)) == config
