"""The global prefix index: a radix tree over chained block hashes, annotated with holders.

    root
     └─ (h0 h1 h2)            workers {0: t=5.0, 3: t=2.0}
          ├─ (h3 h4)          workers {0: t=5.0}
          └─ (h7)             workers {3: t=2.0}

Each edge holds a run of block hashes and splits where two prompts diverge. Each node records the
workers believed to hold its blocks with the time each last touched them, and the times of recent
hits (Preble's eviction cost weighs a prefix by how often it is reused).

Hashes are chained (router.request): two prompts with equal hashes at block i are equal up to i.
The walks rely on it: a prompt follows an edge as far as the last block they overlap on if that
block agrees, and bisects for where they diverge otherwise, reading O(log n) of an edge's n
blocks. Comparing all of them cost a third of a decision's time at 8k-token prompts.

Invariants (`check_integrity` verifies them, tests call it after every operation):
- a worker that holds a node holds its parent: eviction takes a worker's least recently used
  *leaves*, so a worker's holdings are always a rooted subtree;
- `num_blocks(w)` equals the summed edge lengths of the nodes `w` holds;
- a non-root node has at least one holder or one child (empty branches are pruned).

The clock is passed in as `now`; the index never reads one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterator, Sequence
from collections.abc import Set as AbstractSet

from router.request import BlockHash

WorkerId = int


class Node:
    __slots__ = ("key", "parent", "children", "workers", "hits", "depth")

    def __init__(self, key: tuple[BlockHash, ...], parent: Node | None, depth: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[BlockHash, Node] = {}
        self.workers: dict[WorkerId, float] = {}  # holder -> last touch
        self.hits: deque[float] = deque()
        self.depth = depth  # blocks from the root to the end of this node's edge (fixed)

    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"Node(depth={self.depth}, len={len(self.key)}, workers={sorted(self.workers)})"


class PrefixIndex:
    """Which workers hold which prompt prefixes, at block granularity.

    `hit_window` bounds how far back `hit_count` looks (seconds of the caller's clock).
    """

    def __init__(self, hit_window: float = 180.0) -> None:
        self.root = Node((), None, 0)
        self.hit_window = hit_window
        self._num_blocks: dict[WorkerId, int] = {}
        # Per worker, its nodes from least to most recently touched: eviction order. Every
        # operation touches a path leaf first and its ancestors after, so a node always comes
        # before its ancestors, and walking the order from the front is a valid eviction
        # sequence. With a non-decreasing clock this is the order of (touch, -depth); kept as an
        # insertion-ordered dict because a sorted list's deletes cost milliseconds at times.
        self._lru: dict[WorkerId, dict[Node, None]] = {}
        self._versions: dict[WorkerId, int] = {}  # see version()

    # ----------------------------------------------------------------- queries

    def match(self, hashes: Sequence[BlockHash], more_than: int = 0) -> dict[WorkerId, int]:
        """Matched prefix length in blocks for every worker holding more than `more_than`
        blocks of it (by default: at least one).

        One walk from the root: a worker's match ends where it stops holding the path. Since a
        worker's holdings are a rooted subtree, a node's holders are exactly the workers that
        match at least down to it; the holders of nodes ending within the first `more_than` blocks
        are not read.
        """
        matched: dict[WorkerId, int] = {}
        node, pos, n = self.root, 0, len(hashes)
        while pos < n:
            child = node.children.get(hashes[pos])
            if child is None:
                break
            common = _common_prefix(child.key, hashes, pos)
            end = pos + common
            if end > more_than:
                for w in child.workers:
                    matched[w] = end
            if common < len(child.key):
                break
            node, pos = child, end
        return matched

    def match_of(self, hashes: Sequence[BlockHash], worker: WorkerId) -> int:
        """Blocks of the prefix `hashes` that `worker` holds: `match(hashes).get(worker, 0)`
        without reading the other holders."""
        node, pos, n = self.root, 0, len(hashes)
        while pos < n:
            child = node.children.get(hashes[pos])
            if child is None or worker not in child.workers:
                break
            common = _common_prefix(child.key, hashes, pos)
            pos += common
            if common < len(child.key):
                break
            node = child
        return pos

    def longest_match(
        self, hashes: Sequence[BlockHash], eligible: AbstractSet[WorkerId]
    ) -> tuple[int, Collection[WorkerId]]:
        """The longest prefix of `hashes` an `eligible` worker holds, in blocks, and the workers
        holding that much: the deepest node with an eligible holder, and its holders, eligible
        or not (read-only, until the index next changes). Reads one holder per node on the way
        down, where `match` reads every holder of every node, and hands the last node's holders
        over as they are: a prefix held across a large fleet has hundreds, and the caller
        usually wants one of them (lpm: the first in the fleet's queue order)."""
        deepest, length = None, 0
        node, pos, n = self.root, 0, len(hashes)
        while pos < n:
            child = node.children.get(hashes[pos])
            if child is None or child.workers.keys().isdisjoint(eligible):
                break
            common = _common_prefix(child.key, hashes, pos)
            deepest, length = child, pos + common
            if common < len(child.key):
                break
            node, pos = child, length
        if deepest is None:
            return 0, ()
        return length, deepest.workers.keys()

    def num_blocks(self, worker: WorkerId) -> int:
        return self._num_blocks.get(worker, 0)

    def version(self, worker: WorkerId) -> int:
        """A number that changes whenever `worker`'s eviction order does, or the edge of a
        node it holds (a split): what is derived from its victims may be kept until then."""
        return self._versions.get(worker, 0)

    @property
    def workers(self) -> list[WorkerId]:
        return [w for w, n in self._num_blocks.items() if n > 0]

    def hit_count(self, node: Node, now: float) -> int:
        self._expire_hits(node, now)
        return len(node.hits)

    def path(self, hashes: Sequence[BlockHash]) -> list[Node]:
        """Nodes fully covered by `hashes`, root excluded (for cost terms that weigh a path)."""
        out: list[Node] = []
        node, pos = self.root, 0
        while pos < len(hashes):
            child = node.children.get(hashes[pos])
            if child is None or _common_prefix(child.key, hashes, pos) < len(child.key):
                break
            out.append(child)
            node, pos = child, pos + len(child.key)
        return out

    def nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # --------------------------------------------------------------- mutations

    def insert(
        self, hashes: Sequence[BlockHash], worker: WorkerId, now: float, hits_from: int = 0
    ) -> int:
        """Record that `worker` holds the whole prefix `hashes`, touched at `now`.

        Every node on the path past the first `hits_from` blocks gets a hit at `now` (a KV
        event extending a known prefix counts no reuse of that prefix). Returns the number of
        blocks newly held.
        """
        node, pos, n = self.root, 0, len(hashes)
        added = 0
        path: list[Node] = []
        while pos < n:
            child = node.children.get(hashes[pos])
            if child is None:
                child = Node(tuple(hashes[pos:]), node, n)
                node.children[hashes[pos]] = child
            else:
                common = _common_prefix(child.key, hashes, pos)
                if common < len(child.key):
                    child = self._split(child, common)
            if worker not in child.workers:
                added += len(child.key)
            path.append(child)
            if pos + len(child.key) > hits_from:
                self._hit(child, now)
            node, pos = child, pos + len(child.key)
        self._touch_path(path, worker, now)
        self._num_blocks[worker] = self._num_blocks.get(worker, 0) + added
        return added

    def touch(self, hashes: Sequence[BlockHash], worker: WorkerId, now: float) -> int:
        """`worker` is about to reuse the part of `hashes` it holds: refresh that prefix's
        recency and count a hit on it, as `insert` does, without claiming anything new. For
        precise mode, where only the worker's KV events say what it holds (vLLM sends none on a
        cache hit). Returns the blocks matched, as `match` would for `worker`."""
        node, pos, n = self.root, 0, len(hashes)
        path: list[Node] = []
        while pos < n:
            child = node.children.get(hashes[pos])
            if child is None or worker not in child.workers:
                break
            path.append(child)
            self._hit(child, now)
            common = _common_prefix(child.key, hashes, pos)
            pos += common
            if common < len(child.key):
                break
            node = child
        self._touch_path(path, worker, now)
        return pos

    def evict(self, worker: WorkerId, capacity_blocks: int) -> int:
        """Drop `worker`'s least recently used leaves until it holds at most `capacity_blocks`.

        Whole nodes go at a time, so the worker may end a node's length below capacity.
        Returns the number of blocks evicted.
        """
        lru = self._lru.get(worker)
        evicted = 0
        while self._num_blocks.get(worker, 0) > capacity_blocks and lru:
            # A leaf of the worker's: the LRU order puts descendants first (check_integrity
            # verifies it; checked here, it cost a pass over the children of shared nodes).
            evicted += self._drop(next(iter(lru)), worker)
        return evicted

    def eviction_victims(self, worker: WorkerId, num_blocks: int) -> list[Node]:
        """The nodes `evict` would drop first to free `num_blocks` of `worker`'s, without
        dropping them (Preble's eviction cost weighs what a placement would push out)."""
        victims: list[Node] = []
        freed = 0
        for node in self._lru.get(worker, ()):
            if freed >= num_blocks:
                break
            victims.append(node)
            freed += len(node.key)
        return victims

    def remove_prefix(self, hashes: Sequence[BlockHash], worker: WorkerId) -> int:
        """`worker` no longer holds the last block of `hashes`, nor anything below it (a prefix
        match could not reach those). Returns the number of blocks dropped."""
        if not hashes:
            return 0
        target = len(hashes) - 1
        node, pos = self.root, 0
        while True:
            child = node.children.get(hashes[pos])
            if child is None or worker not in child.workers:
                return 0
            common = _common_prefix(child.key, hashes, pos)
            if pos + len(child.key) > target:  # the block lies on this edge
                if common <= target - pos:
                    return 0
                if target > pos:
                    self._split(child, target - pos)  # `child` now starts at the block
                break
            if common < len(child.key):
                return 0
            node, pos = child, pos + len(child.key)
        held = [n for n in self._subtree(child) if worker in n.workers]
        held.sort(key=lambda n: n.depth, reverse=True)
        return sum(self._drop(n, worker) for n in held)

    def _subtree(self, top: Node) -> Iterator[Node]:
        stack = [top]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def remove_worker(self, worker: WorkerId) -> int:
        """Forget everything `worker` holds (it went down or was drained)."""
        held = [node for node in self.nodes() if worker in node.workers]
        # Deepest first so pruning never visits a node twice.
        held.sort(key=lambda node: node.depth, reverse=True)
        dropped = sum(self._drop(node, worker) for node in held)
        self._lru.pop(worker, None)
        self._num_blocks.pop(worker, None)
        return dropped

    # ---------------------------------------------------------------- internals

    def _touch_path(self, path: list[Node], worker: WorkerId, now: float) -> None:
        """Make a root-to-leaf path the worker's most recent, leaf first: an ancestor must
        never be evicted before its descendant."""
        lru = self._lru.get(worker)
        if lru is None:
            lru = self._lru[worker] = {}
        self._versions[worker] = self._versions.get(worker, 0) + 1
        for node in reversed(path):
            lru.pop(node, None)
            lru[node] = None
            node.workers[worker] = now

    def _drop(self, node: Node, worker: WorkerId) -> int:
        del node.workers[worker]
        del self._lru[worker][node]
        self._versions[worker] += 1
        self._num_blocks[worker] -= len(node.key)
        self._prune(node)
        return len(node.key)

    def _prune(self, node: Node) -> None:
        while node.parent is not None and not node.workers and not node.children:
            parent = node.parent
            del parent.children[node.key[0]]
            node.parent = None
            node = parent

    def _split(self, child: Node, at: int) -> Node:
        """Cut `child`'s edge after `at` blocks; returns the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key), "split inside a real edge"
        upper = Node(child.key[:at], parent, child.depth - len(child.key) + at)
        upper.workers = dict(child.workers)
        upper.hits = deque(child.hits)
        parent.children[upper.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        # The upper part must follow `child` and precede its own ancestors in each holder's
        # order: it and its ancestors move to the end. An insert touches that path at once
        # anyway; a split by remove_prefix makes it look recent.
        for worker in upper.workers:
            self._versions[worker] += 1
            lru = self._lru[worker]
            node = upper
            while node is not self.root:
                lru.pop(node, None)
                lru[node] = None
                node = node.parent  # type: ignore[assignment]
        return upper

    def _hit(self, node: Node, now: float) -> None:
        node.hits.append(now)
        self._expire_hits(node, now)

    def _expire_hits(self, node: Node, now: float) -> None:
        horizon = now - self.hit_window
        hits = node.hits
        while hits and hits[0] < horizon:
            hits.popleft()

    def check_integrity(self) -> None:
        counted: dict[WorkerId, int] = {}
        for node in self.nodes():
            parent = node.parent
            assert parent is not None, "reachable node without a parent"
            assert node.key, "empty edge"
            assert parent.children.get(node.key[0]) is node, "child keyed by its first hash"
            assert node.depth == parent.depth + len(node.key), f"depth of {node}"
            assert node.workers or node.children, f"unpruned empty branch {node}"
            for w, touch in node.workers.items():
                counted[w] = counted.get(w, 0) + len(node.key)
                if parent is not self.root:
                    assert w in parent.workers, f"worker {w} holds {node} but not its parent"
                    assert parent.workers[w] >= touch, "ancestor touched no later than descendant"
        for w, n in self._num_blocks.items():
            assert counted.get(w, 0) == n, f"worker {w}: counted {counted.get(w, 0)} != {n}"
            order = {node: i for i, node in enumerate(self._lru.get(w, ()))}
            held = {node for node in self.nodes() if w in node.workers}
            assert set(order) == held, f"worker {w}: LRU order out of step with holdings"
            for node, i in order.items():
                parent = node.parent
                assert parent is not None, "the root is in no LRU order"
                assert parent is self.root or order[parent] > i, "an ancestor before its child"


def _common_prefix(key: tuple[BlockHash, ...], hashes: Sequence[BlockHash], pos: int) -> int:
    """Length of the common prefix of `key` and `hashes[pos:]` (key[0] is known to match).

    Chained hashes agree up to where two prompts diverge and differ from there on: the whole
    overlap is common if its last block is, and otherwise the divergence is found by bisection.
    """
    n = min(len(key), len(hashes) - pos)
    if key[n - 1] == hashes[pos + n - 1]:
        return n
    lo, hi = 1, n - 1  # equal below `lo`, different from `hi` on
    while lo < hi:
        mid = (lo + hi) // 2
        if key[mid] == hashes[pos + mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo
