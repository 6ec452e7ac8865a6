"""A block's identity is its tokens and its cache identity (model group, LoRA adapter, cache
salt): the same tokens under another identity never match, in either index mode; routing keeps
to a model's group and prefers an adapter's holders."""

from __future__ import annotations

import pytest

import policies
from router.config import RouterConfig
from router.core import Router
from router.cost_model import roofline
from router.kv_events import KVEventIndexer
from router.pools import UnknownModel
from router.prefix_index import PrefixIndex
from router.request import Request, cache_root, hash_token_blocks
from simulator.config import SimConfig
from simulator.driver import simulate
from simulator.engine import EngineConfig
from traces.schema import Trace

BS = 16
COST = roofline("llama-3-8b", "a100-80g")
TOKENS = list(range(1000, 1000 + 20 * BS))  # 20 full blocks
IDENTITIES = [  # pairs of identities whose blocks must never match each other
    pytest.param({"adapter": "A"}, {"adapter": "B"}, id="adapters"),
    pytest.param({"cache_salt": "s1"}, {"cache_salt": "s2"}, id="salts"),
    pytest.param({}, {"adapter": "A"}, id="base-vs-adapter"),
    pytest.param({"adapter": "A"}, {"adapter": "A", "cache_salt": "s1"}, id="adapter-vs-salted"),
]


def request(i: int, identity: dict[str, str], tokens: list[int] = TOKENS, at: float = 0.0):
    """Request `i` for `tokens` (one token past the full blocks), hashed under `identity`."""
    hashes = hash_token_blocks(tokens, BS, cache_root(**identity))
    return Request(i, at, len(tokens) + 1, 4, hashes, **identity)  # type: ignore[arg-type]


def router(policy: str = "lpm", workers: int = 2, load_time: float = 0.0, **add) -> Router:
    r = Router(
        policies.global_policies.create(policy),
        lambda: policies.local_policies.create("fcfs"),
        RouterConfig(block_size=BS, window=None, cost=COST, adapter_load_time=load_time),
    )
    for w in range(workers):
        r.add_worker(w, **add)
    return r


class TestApproximateIndex:
    """Routing inserts a prompt's blocks on its worker: under its identity, no other."""

    @pytest.mark.parametrize(("first", "second"), IDENTITIES)
    def test_same_tokens_under_another_identity_never_match(self, first, second) -> None:
        r = router(workers=1)
        one = request(0, first)
        r.route(one, 0.0)
        other = request(1, second)
        assert r.view.index.match_of(other.block_hashes, 0) == 0
        assert r.route(other, 1.0).hit_blocks == 0, "a hit predicted across identities"
        again = request(2, first, at=2.0)
        assert r.route(again, 2.0).hit_blocks == 20, "the same identity still matches"


def stored(names: list[int], tokens: list[int], lora: str | None, extra_keys: list) -> dict:
    """A BlockStored event as vLLM sends it (docs/vllm-lora.md: per-block extra_keys, the first
    block's carrying [lora_name, cache_salt] or [cache_salt])."""
    return {
        "type": "BlockStored",
        "block_hashes": names,
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None if lora is None else 1,
        "medium": "GPU",
        "lora_name": lora,
        "extra_keys": extra_keys,
    }


def vllm_event(identity: dict[str, str], names: list[int]) -> dict:
    """What a worker serving `TOKENS` under `identity` emits."""
    lora, salt = identity.get("adapter"), identity.get("cache_salt")
    n = len(names)
    per_block: list[list[str] | None] = [[lora] if lora else None for _ in range(n)]
    first = [k for k in (lora, salt) if k]
    per_block[0] = first or None
    return stored(names, TOKENS[: n * BS], lora, per_block)


class TestPreciseIndex:
    """KV events name the identity (lora_name, extra_keys); the indexer hashes under it, as
    the proxy hashes a prompt for that identity."""

    @pytest.mark.parametrize(("first", "second"), IDENTITIES)
    def test_a_prompt_matches_only_the_worker_holding_its_identity(self, first, second) -> None:
        index = PrefixIndex()
        for worker, identity in ((0, first), (1, second)):
            names = [worker * 100 + k for k in range(20)]  # vLLM's own block names
            KVEventIndexer(index, worker, BS).apply([vllm_event(identity, names)], 0.0)
        for worker, identity in ((0, first), (1, second)):
            hashes = hash_token_blocks(TOKENS, BS, cache_root(**identity))
            assert index.match(hashes) == {worker: 20}, f"{identity} matched elsewhere"

    def test_a_worker_of_a_model_group_hashes_under_its_model(self) -> None:
        index = PrefixIndex()
        KVEventIndexer(index, 0, BS, model="m").apply([vllm_event({}, list(range(20)))], 0.0)
        under_model = hash_token_blocks(TOKENS, BS, cache_root(model="m"))
        assert index.match(under_model) == {0: 20}
        assert index.match(hash_token_blocks(TOKENS, BS)) == {}


class TestPredictionStaysHonest:
    """Two adapters sharing prompts in a simulation: routing predicts only hits the engines
    then make (the engine reuses a block only under the identity it was computed for)."""

    def test_predicted_hits_match_the_engines_actual_ones(self) -> None:
        prompts = [list(range(k * 10_000, k * 10_000 + 40 * BS)) for k in range(4)]
        reqs = [
            request(i, {"adapter": "A" if (i // 4) % 2 == 0 else "B"}, prompts[i % 4], at=0.5 * i)
            for i in range(32)
        ]
        trace = Trace(reqs, BS)
        engine = EngineConfig(adapter_slots=2, adapter_load_time=0.05, check_invariants=True)
        result = simulate(trace, COST, SimConfig(num_workers=2, policy="lpm", engine=engine))
        cache = result.summary["prefix_cache"]
        assert cache["hit_rate"] > 0.5, "the same identity reuses its prompts"
        assert cache["predicted_hit_rate"] == pytest.approx(cache["hit_rate"], abs=1e-9)
        by_id = {r.id: r for r in result.records}
        for i in (4, 5, 6, 7):  # B's first use of each prompt A computed just before
            assert by_id[i].cached_tokens == 0, f"request {i} hit another adapter's blocks"


class TestModelGroups:
    def test_a_request_goes_only_to_its_model_groups_workers(self) -> None:
        r = router("least_load", workers=0)
        for wid, model in ((0, "x"), (1, "x"), (2, "y"), (3, "y")):
            r.add_worker(wid, model=model)
        chosen = {m: set() for m in ("x", "y")}
        for i in range(40):
            model = "x" if i % 3 else "y"
            req = Request(i, 0.0, 100, 4, [i], model=model)
            chosen[model].add(r.route(req, 0.0).decision.worker)
        assert chosen == {"x": {0, 1}, "y": {2, 3}}
        assert r.pools.models() == ["x", "y"]

    def test_a_model_no_group_serves_is_refused(self) -> None:
        r = router("least_load", workers=0)
        r.add_worker(0, model="x")
        with pytest.raises(UnknownModel, match="'z'"):
            r.route(Request(0, 0.0, 100, 4, model="z"), 0.0)


class TestAdapterAffinity:
    """Holders first, unless another worker would start the request sooner after a load."""

    def long_request(self, i: int) -> Request:
        return request(i, {"adapter": "A"}, list(range(i * 10_000, i * 10_000 + 8000)))

    def test_with_the_holder_idle_enough_requests_go_to_it(self) -> None:
        r = router("least_load", load_time=10.0, adapter_slots=2)
        first = r.route(self.long_request(0), 0.0)
        assert first.adapter_load and r.adapters.holds(first.decision.worker, "A")
        # least_load alone would pick the idle worker; the load would cost more than waiting.
        second = r.route(self.long_request(1), 0.0)
        assert second.decision.worker == first.decision.worker and not second.adapter_load
        assert r.adapters.loads == 1

    def test_with_the_holder_busy_and_loads_cheap_they_spill(self) -> None:
        r = router("least_load", load_time=0.01, adapter_slots=2)
        first = r.route(self.long_request(0), 0.0)
        second = r.route(self.long_request(1), 0.0)  # 8k tokens ahead on the holder: ~0.7 s
        assert second.decision.worker != first.decision.worker and second.adapter_load
        assert r.adapters.holders["A"] == {0, 1}
