"""The C store (simulator/cached_blocks.c) against its definition in Python, operation by operation.

Random sequences of admissions (prefix, num_free_of, pin, add), releases, evictions and clears
drive both; after each, their answers, the lists they appended to, their free queues (stale
entries included), their counts and every block's holders must be the same. Keys mix small ints,
negatives and the edges of the 64- and 128-bit ranges, and a run names enough blocks for the
C store's index and slab to grow several times, and evicts enough for it to reuse slots.
"""

from __future__ import annotations

import importlib
import os
import random
from typing import Any

import pytest

from router.runtime.native import native_root, put_shared_on_path
from simulator.cached_blocks import CachedBlocks

SPECIAL = [
    0,
    1,
    -1,
    2,
    -2,
    2**31,
    2**32,
    2**63 - 1,
    2**63,
    2**63 + 1,
    -(2**63),
    -(2**63) - 1,
    2**64 - 1,
    2**64,
    2**64 + 1,
    -(2**64),
    2**100,
    -(2**100),
    -(2**127),
    -(2**127) + 1,
    2**127 - 1,
    2**127 - 2,
]


@pytest.fixture(scope="module")
def c_type() -> Any:
    root = native_root()
    if root is None:
        if os.environ.get("FAIRWAY_REQUIRE_NATIVE"):
            pytest.fail("FAIRWAY_REQUIRE_NATIVE is set, but build/native is not built")
        pytest.skip("build/native is not built (make native)")
    put_shared_on_path(root)
    return importlib.import_module("fairway_cached_blocks").CachedBlocks


def make_pool(rng: random.Random, size: int) -> list[int]:
    keys = set(SPECIAL)
    while len(keys) < size:
        kind = rng.randrange(7)
        if kind == 0:
            keys.add(rng.randrange(-1000, 1000))
        elif kind == 1:
            keys.add(2**63 + rng.randrange(-1000, 1000))
        elif kind == 2:
            keys.add(2**64 + rng.randrange(-1000, 1000))
        elif kind == 3:
            keys.add(rng.choice((1, -1)) * 2**100 + rng.randrange(-1000, 1000))
        elif kind == 4:
            keys.add(rng.getrandbits(128) - 2**127)
        else:
            keys.add(rng.getrandbits(64))  # as block hashes are
    pool = sorted(keys)
    rng.shuffle(pool)
    return pool


def fresh(key: int) -> int:
    """An int equal to `key` but, past the small ints, another object: so that a store that
    appended a key it had kept, not the one it was given, fails the identity checks."""
    return int(str(key))


def same(py: CachedBlocks, c: Any) -> None:
    assert len(c) == len(py)
    assert c.num_free == py.num_free
    assert c.free_queue() == py.free_queue()
    keys = py.keys()
    c_keys = c.keys()
    assert len(c_keys) == len(keys) and set(c_keys) == set(keys)
    for key in keys:
        assert key in c
        assert c.holders(key) == py.holders(key)


def appended(py_held: list[int], c_held: list[int], before: int, keys: list[int]) -> None:
    """Equal lists, and what both appended is the very objects of `keys`."""
    assert c_held == py_held
    ids = {id(k) for k in keys}
    for a, b in zip(py_held[before:], c_held[before:], strict=True):
        assert a is b and id(b) in ids


class Run:
    """One random sequence of operations on both stores, compared after each."""

    def __init__(
        self,
        c_type: Any,
        seed: int,
        pool_size: int,
        stale_slack: int,
        max_seqs: int = 40,
        capacity: int = 0,
    ) -> None:
        self.rng = random.Random(seed)
        self.pool = make_pool(self.rng, pool_size)
        self.chains: list[list[int]] = []
        at = 0
        while at < len(self.pool):
            n = self.rng.randint(1, 24)
            self.chains.append(self.pool[at : at + n])
            at += n
        self.py = CachedBlocks(capacity)
        self.c = c_type(capacity)
        self.py.stale_slack = self.c.stale_slack = stale_slack
        self.seqs: list[tuple[list[int], list[int], list[int]]] = []  # keys, py held, c held
        self.max_seqs = max_seqs

    def prompt(self) -> list[int]:
        rng = self.rng
        if rng.random() < 0.8:
            chain = rng.choice(self.chains)
            keys = chain[: rng.randint(1, len(chain))]
        else:  # no chain: blocks cached anywhere in it, duplicates too
            keys = [rng.choice(self.pool) for _ in range(rng.randint(1, 12))]
        return [fresh(k) for k in keys]

    def admit(self) -> None:
        py, c, rng = self.py, self.c, self.rng
        keys = self.prompt()
        limit = rng.randint(0, len(keys) + 1)
        n = py.prefix(keys, limit)
        assert c.prefix(keys, limit) == n
        assert c.num_free_of(keys, n) == py.num_free_of(keys, n)
        py_held: list[int] = []
        c_held: list[int] = []
        assert c.pin(keys, n, c_held) == py.pin(keys, n, py_held)
        appended(py_held, c_held, 0, keys)
        self.seqs.append((keys, py_held, c_held))
        if rng.random() < 0.8:
            self.commit(len(self.seqs) - 1)

    def commit(self, i: int) -> None:
        keys, py_held, c_held = self.seqs[i]
        start = len(py_held)
        stop = self.rng.randint(start - 1, len(keys))  # start - 1: an empty range
        named = self.py.add(keys, start, stop, py_held)
        assert self.c.add(keys, start, stop, c_held) == named
        appended(py_held, c_held, start, keys)

    def release(self, i: int) -> None:
        _, py_held, c_held = self.seqs.pop(i)
        assert self.c.release(c_held) == self.py.release(py_held)
        assert py_held == c_held == []

    def evict(self, n: int) -> None:
        if self.rng.random() < 0.5:
            self.py.evict(n)
            assert self.c.evict(n) is None
        else:
            py_out: list[int] = [-7]
            c_out: list[int] = [-7]
            self.py.evict(n, py_out)
            assert self.c.evict(n, c_out) is None
            assert c_out == py_out

    def query(self) -> None:
        rng = self.rng
        keys = [fresh(rng.choice(self.pool)) for _ in range(rng.randint(0, 6))]
        limit = rng.randint(-1, 8)
        assert self.c.prefix(keys, limit) == self.py.prefix(keys, limit)
        for k in keys:
            assert (k in self.c) == (k in self.py)

    def check(self, full: bool = True) -> None:
        """`same`, or with `full` false only what is cheap: counts and the free queue."""
        if full:
            same(self.py, self.c)
        else:
            assert len(self.c) == len(self.py) and self.c.num_free == self.py.num_free
            assert self.c.free_queue() == self.py.free_queue()

    def steps(self, n: int) -> None:
        """`n` random operations, the stores compared after each."""
        for _ in range(n):
            self.step()
            self.check()

    def step(self) -> None:
        rng = self.rng
        r = rng.random()
        if r < 0.45 or not self.seqs:
            self.admit()
        elif r < 0.55:
            self.commit(rng.randrange(len(self.seqs)))
        elif r < 0.8 or len(self.seqs) > self.max_seqs:
            self.release(rng.randrange(len(self.seqs)))
        elif r < 0.9:
            self.evict(rng.randint(0, min(self.py.num_free, 12)))
        elif r < 0.905:  # everything free, as reset_prefix_cache
            self.evict(self.py.num_free)
        elif r < 0.997:
            self.query()
        else:  # every block forgotten, the sequences dropped with them
            self.py.clear()
            self.c.clear()
            self.seqs.clear()


# Many keys and sequences: the store grows; few of both: blocks are freed, pinned and freed
# again, their entries going stale, and the queue is rebuilt often.
@pytest.mark.parametrize("pool_size,max_seqs", [(600, 40), (60, 3)])
@pytest.mark.parametrize("stale_slack", [0, 3, 64])
@pytest.mark.parametrize("seed", range(6))
def test_same_as_python(
    c_type: Any, seed: int, stale_slack: int, pool_size: int, max_seqs: int
) -> None:
    run = Run(c_type, seed, pool_size, stale_slack, max_seqs)
    run.steps(400)


# Room made up front for fewer blocks than come (the arrays grow past it), for about as
# many, and for far more: the store answers the same whatever it reserved.
@pytest.mark.parametrize("pool_size,max_seqs", [(600, 40), (60, 3)])
@pytest.mark.parametrize("capacity", [1, 37, 1000])
@pytest.mark.parametrize("seed", range(3))
def test_same_as_python_with_room_made_up_front(
    c_type: Any, seed: int, capacity: int, pool_size: int, max_seqs: int
) -> None:
    run = Run(c_type, 200 + seed, pool_size, 3, max_seqs, capacity)
    run.steps(400)


@pytest.mark.parametrize("seed", range(2))
def test_same_as_python_growing_and_shrinking(c_type: Any, seed: int) -> None:
    """Thousands of blocks named (the index and slab grow many times), then nearly all
    evicted, then named again in their freed slots. Each block's holders are compared after
    every operation while there are few, every 25th once there are many."""
    run = Run(c_type, 100 + seed, pool_size=3000, stale_slack=3 if seed else 64)
    ops = 0

    def check() -> None:
        nonlocal ops
        ops += 1
        run.check(len(run.py) < 300 or ops % 25 == 0)

    for phase in range(2):
        for _ in range(3000):
            if len(run.py) >= 2000:
                break
            if run.seqs and (len(run.seqs) > 30 or run.rng.random() < 0.3):
                run.release(run.rng.randrange(len(run.seqs)))
            elif phase and run.rng.random() < 0.3:
                run.admit()  # pins, leaving stale entries
            else:
                keys = [fresh(k) for k in run.rng.choice(run.chains)]
                py_held: list[int] = []
                c_held: list[int] = []
                named = run.py.add(keys, 0, len(keys), py_held)
                assert run.c.add(keys, 0, len(keys), c_held) == named
                appended(py_held, c_held, 0, keys)
                run.seqs.append((keys, py_held, c_held))
            check()
        assert len(run.c) >= 1000
        run.check()
        while run.seqs:
            run.release(0)
            check()
        for _ in range(10):
            run.evict(run.py.num_free // 3 + 1 if run.py.num_free else 0)
            run.check()
        assert len(run.c) < 100
    run.steps(200)


def snapshot(c: Any) -> tuple:
    return (
        len(c),
        c.num_free,
        c.free_queue(),
        sorted(c.keys()),
        [c.holders(k) for k in sorted(c.keys())],
    )


def filled(store_type: Any) -> tuple[Any, list[int], list[int]]:
    """A store with free blocks, some with stale entries, and a sequence holding others."""
    c = store_type()
    keys = [fresh(k) for k in SPECIAL]
    held: list[int] = []
    assert c.add(keys, 0, len(keys), held) == len(keys)
    c.release(held)
    assert c.pin(keys, 5, held) == 5
    c.release(held)
    assert c.pin(keys, 8, held) == 8
    return c, keys, held


def test_keys_round_trip(c_type: Any) -> None:
    c, keys, held = filled(c_type)
    assert sorted(c.keys()) == sorted(SPECIAL)
    assert sorted(c.free_queue()) == sorted(SPECIAL + SPECIAL[:5])
    assert [c.holders(k) for k in keys[:8]] == [(1, 2)] * 5 + [(1, 1)] * 3
    for k in SPECIAL:
        assert k in c and fresh(k) in c
    assert c.prefix(keys, len(keys)) == len(keys)
    out: list[int] = []
    c.release(held)
    c.evict(c.num_free, out)
    assert sorted(out) == sorted(SPECIAL) and len(c) == 0


def test_keys_out_of_range_or_not_ints(c_type: Any) -> None:
    c, keys, held = filled(c_type)
    before = snapshot(c)
    for bad in (2**127, -(2**127) - 1, 2**200, -(2**1000)):
        assert bad not in c
        with pytest.raises(OverflowError, match="128-bit"):
            c.add([bad], 0, 1, [])
        with pytest.raises(KeyError):
            c.holders(bad)
        assert c.prefix([keys[0], bad], 2) == 1
    for bad in ("1", 1.0, None, (1,), b"x"):
        assert bad not in c
        with pytest.raises(TypeError):
            c.add([bad], 0, 1, [])
        with pytest.raises(KeyError):
            c.holders(bad)
    assert True in c  # an int, equal to 1, as a dict would say
    assert snapshot(c) == before


def test_add_stops_at_a_bad_key_keeping_those_before(c_type: Any) -> None:
    c = c_type()
    held: list[int] = []
    with pytest.raises(TypeError):
        c.add([10, 11, "x", 12], 0, 4, held)
    assert held == [10, 11] and sorted(c.keys()) == [10, 11]
    py = CachedBlocks()
    py_held: list[int] = []
    assert py.add([10, 11], 0, 2, py_held) == 2
    for store, out in ((py, py_held), (c, held)):
        with pytest.raises(IndexError):
            store.add([13, 14], 0, 3, out)
        assert store.add([15, 16], -2, 0, out) == 2  # as keys[-2], keys[-1]
        assert store.add([17], 1, 0, out) == 0
    assert held == py_held == [10, 11, 13, 14, 15, 16]
    same(py, c)


def test_keys_past_the_first_run_read_ahead(c_type: Any) -> None:
    # The C store reads keys ahead in runs of 16 (`warm` in cached_blocks.c): an error past
    # the first run is raised at its key, and what it did before stands.
    c = c_type()
    keys = list(range(1000, 1040))
    held: list[int] = []
    with pytest.raises(TypeError):
        c.add([*keys[:20], "x", *keys[20:]], 0, 41, held)
    assert held == keys[:20]
    with pytest.raises(KeyError):
        c.release([12345, *held])  # released last first: the bad one the 21st
    assert len(held) == 20 and all(c.holders(k) == (1, 0) for k in held)
    assert c.release(held) == 20
    py = CachedBlocks()
    py.add(keys[:20], 0, 20, [])
    py.release(list(keys[:20]))
    for store in (py, c):
        grown = list(range(2000, 2030))  # `held` the very list of keys, growing as it is read
        assert store.add(grown, 0, 30, grown) == 30 and grown[30:] == grown[:30]
        assert store.add(keys, -20, 40, []) == 20  # keys[-20:], then keys[0] is cached
        assert store.release(grown[30:]) == 30
    same(py, c)


def test_evict_beyond_num_free(c_type: Any) -> None:
    c, _, _ = filled(c_type)
    py, _, _ = filled(CachedBlocks)
    before = snapshot(c)
    assert snapshot(py) == before
    for n in (c.num_free + 1, 2**80):
        with pytest.raises(ValueError) as c_error:
            c.evict(n, [])
        with pytest.raises(ValueError) as py_error:
            py.evict(n, [])
        assert str(c_error.value) == str(py_error.value)
    for store in (c, py):
        with pytest.raises(ValueError, match="evicting -1 of"):
            store.evict(-1)
    assert snapshot(c) == before


def test_failed_pin_and_release_change_nothing(c_type: Any) -> None:
    c, keys, held = filled(c_type)
    before = snapshot(c)
    out: list[int] = [1]
    with pytest.raises(KeyError):
        c.pin([*keys[:3], 12345, keys[3]], 5, out)  # absent
    with pytest.raises(IndexError):
        c.pin(keys[:3], 4, out)
    assert out == [1] and snapshot(c) == before
    with pytest.raises(KeyError):
        c.num_free_of([keys[0], 12345], 2)
    with pytest.raises(IndexError):
        c.num_free_of(keys[:2], 3)
    with pytest.raises(KeyError):
        c.release([12345, *held])  # released last first: the bad one comes last
    with pytest.raises(ValueError, match="nobody holds"):
        c.release([keys[-1], *held])  # a free block
    with pytest.raises(ValueError, match="nobody holds"):
        c.release([*held, held[-1]])  # held once, released twice
    assert len(held) == 8 and snapshot(c) == before
    py, py_keys, _ = filled(CachedBlocks)
    with pytest.raises(ValueError, match="nobody holds"):
        py.release([py_keys[-1]])  # the Python class refuses it too (before changing anything)
    with pytest.raises(TypeError):
        c.pin(tuple(keys), 1, [])
    assert c.release(held) == 8 and held == []


def test_clear(c_type: Any) -> None:
    c, keys, held = filled(c_type)
    c.stale_slack = 3
    c.clear()
    assert len(c) == 0 and c.num_free == 0 and c.keys() == [] and c.free_queue() == []
    assert c.stale_slack == 3 and keys[0] not in c
    c.clear()
    held = []
    assert c.add(keys, 0, 4, held) == 4 and c.release(held) == 4
    assert c.free_queue() == SPECIAL[3::-1]


def test_attributes(c_type: Any) -> None:
    c = c_type()
    assert c.stale_slack == 64 and c.num_free == 0 and len(c) == 0
    c.stale_slack = 0
    assert c.stale_slack == 0
    with pytest.raises(AttributeError):
        c.num_free = 3
    with pytest.raises(TypeError):
        c_type(1, 2)
    with pytest.raises(TypeError):
        c_type("1")
    for store_type in (c_type, CachedBlocks):
        with pytest.raises(ValueError, match="capacity"):
            store_type(-1)
    reserved = c_type(capacity=5000)
    assert len(reserved) == 0 and reserved.num_free == 0 and reserved.keys() == []
    with pytest.raises(KeyError):
        c.holders(1)
    c.evict(0)
    c.evict(0, None)


def test_a_large_store(c_type: Any) -> None:
    """A store of 150,000 blocks (its index and slab grown to megabytes) answers as the Python
    store does, through growth, release, eviction and clearing."""
    rng = random.Random(9)
    keys = [rng.getrandbits(64) for _ in range(150_000)]
    py, c = CachedBlocks(), c_type()
    py_held: list[int] = []
    c_held: list[int] = []
    for at in range(0, len(keys), 1000):
        chunk = keys[at : at + 1000]
        assert c.add(chunk, 0, len(chunk), c_held) == py.add(chunk, 0, len(chunk), py_held)
    assert len(c) == len(py) == len(set(keys))
    assert c.release(c_held) == py.release(py_held)
    assert c.free_queue() == py.free_queue()
    c.evict(100_000)
    py.evict(100_000)
    assert c.free_queue() == py.free_queue() and set(c.keys()) == set(py.keys())
    c.clear()
    assert len(c) == 0 and c.num_free == 0 and c.prefix(keys, 10) == 0
