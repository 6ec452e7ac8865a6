"""Split fleets in the router core: roles, the two routing decisions, and fairness charged to
the prefill worker across both stages; driven by hand."""

from __future__ import annotations

import pytest

import policies
from router.config import RouterConfig
from router.core import Router
from router.decode import choose_decode
from router.pools import UnknownModel
from router.request import Request
from router.traits import Role
from tests.helpers import BS

P0, P1, D0, D1, M0 = 0, 1, 2, 3, 4


def req(
    i: int, client: str = "a", blocks: int = 4, doc: int | None = None, out: int = 8
) -> Request:
    base = 1000 * (i if doc is None else doc)
    hashes = [base + k for k in range(blocks)]
    return Request(i, 0.0, blocks * BS + 1, out, hashes, client=client)


def split_router(policy: str = "lpm", mixed: bool = False, window: int | None = 8) -> Router:
    router = Router(
        policies.global_policies.build(policy, {}, 0),
        lambda: policies.local_policies.build("fcfs", {}, 0),
        RouterConfig(block_size=BS, window=window),
    )
    for wid, role in ((P0, "prefill"), (P1, "prefill"), (D0, "decode"), (D1, "decode")):
        router.add_worker(wid, role=role)
    if mixed:
        router.add_worker(M0)
    return router


def test_a_request_is_prefilled_then_decoded_on_the_other_pool() -> None:
    router = split_router()
    r = req(1)
    routed = router.route(r, 0.0)
    assert routed.split and routed.decision.worker in (P0, P1)
    assert routed.released == [r]
    prefill = routed.decision.worker
    # The prefill worker carries the prompt only; no decode worker carries anything yet.
    assert router.view.workers[prefill].tokens_in_flight == r.prompt_len
    handoff = router.prefilled(r, 1.0)
    assert handoff.decode in (D0, D1) and handoff.released == [r]
    assert router.view.workers[prefill].tokens_in_flight == 0
    assert router.view.workers[prefill].num_outstanding == 0
    assert router.view.workers[handoff.decode].tokens_in_flight == r.output_len
    router.first_token(r, 1.1)  # the decode worker's: its work is the output alone
    assert router.view.workers[handoff.decode].tokens_in_flight == r.output_len
    router.tokens(r, r.output_len - 1, 1.5)
    assert router.view.workers[handoff.decode].tokens_in_flight == 1
    router.finish(r, 2.0)
    assert all(
        w.tokens_in_flight == 0 and w.num_outstanding == 0 for w in router.view.workers.values()
    )
    assert router.handoffs[handoff.decode] == 1


def test_the_global_policy_never_sees_decode_workers() -> None:
    router = split_router("round_robin")
    chosen = {router.route(req(i), 0.0).decision.worker for i in range(8)}
    assert chosen == {P0, P1}


def test_prefix_locality_lives_on_the_prefill_pool() -> None:
    router = split_router("lpm")
    first = router.route(req(1, doc=7), 0.0).decision.worker
    again = router.route(req(2, doc=7), 0.1).decision.worker
    assert again == first


def test_the_decode_choice_weighs_load_then_its_own_cache() -> None:
    router = split_router()
    a = req(1, doc=5)
    router.route(a, 0.0)
    first = router.prefilled(a, 0.5).decode
    # The next turn of the same conversation (a longer prompt on the same prefix) decodes
    # where the earlier turn's KV is, while that worker is not much busier.
    b = req(2, doc=5, blocks=6)
    router.route(b, 1.0)
    assert router.prefilled(b, 1.5).decode == first
    # An unrelated prompt goes to the least busy decode worker.
    c = req(3, doc=9)
    router.route(c, 2.0)
    assert router.prefilled(c, 2.5).decode != first


def test_a_busy_holder_loses_to_load() -> None:
    router = split_router()
    view = router.pools._decode[None]
    view.workers[D0].num_running = 10
    router.view.index.insert([1000 * 5 + k for k in range(4)], D0, 0.0)
    r = req(1, doc=5)
    assert choose_decode(r, view, slack=4) == D1
    view.workers[D0].num_running = 3
    view.changed(D0)
    assert choose_decode(r, view, slack=4) == D0


def test_without_a_healthy_decode_worker_only_mixed_ones_are_routed_to() -> None:
    router = split_router(mixed=True)
    router.worker_down(D0, 0.0)
    router.worker_down(D1, 0.0)
    routed = router.route(req(1), 0.1)
    assert routed.decision.worker == M0 and not routed.split


def test_a_handoff_with_no_decode_worker_left_ends_the_request() -> None:
    router = split_router()
    r = req(1)
    prefill = router.route(r, 0.0).decision.worker
    router.worker_down(D0, 0.1)
    router.worker_down(D1, 0.1)
    handoff = router.prefilled(r, 0.2)
    assert handoff.decode is None
    assert router.view.workers[prefill].num_outstanding == 0
    assert router.finish(r, 0.3) == []  # gone: nothing left to finish


def test_both_pools_vtc_queues_count_the_whole_request() -> None:
    """The prefill worker's VTC discipline charges the prompt at admission and the output as
    it is decoded on the other worker, as VTC defines service; the decode worker's charges
    the request as its own queue sees it (prompt held and read there, and output). Each
    equals what one mixed worker's discipline charges."""
    charged = {}
    for split in (True, False):
        router = Router(
            policies.global_policies.build("vtc", {}, 0),
            lambda: policies.local_policies.build("vtc", {}, 0),
            RouterConfig(block_size=BS, window=1),
        )
        if split:
            router.add_worker(P0, role="prefill")
            router.add_worker(D0, role="decode")
        else:
            router.add_worker(M0)
        r = req(1, client="x")
        router.route(r, 0.0)
        if split:
            router.prefilled(r, 0.5)
            prompt_only = router.queues[P0].discipline.counters["x"]
        router.first_token(r, 0.6)
        router.tokens(r, 7, 0.9)
        router.finish(r, 1.0)
        charged[split] = {w: q.discipline.counters.get("x", 0.0) for w, q in router.queues.items()}
    meter = policies.local_policies.build("vtc", {}, 0).meter
    r = req(3)
    assert prompt_only == pytest.approx(meter.start(r, r.prompt_len))
    assert charged[True][P0] == pytest.approx(charged[False][M0])
    assert charged[True][P0] > prompt_only
    assert charged[True][D0] == pytest.approx(charged[False][M0])


def test_d2lpm_deficits_stay_on_the_prefill_worker() -> None:
    router = split_router("d2lpm")
    r = req(1, client="x")
    prefill = router.route(r, 0.0).decision.worker
    decode = router.prefilled(r, 0.5).decode
    router.tokens(r, 8, 0.9)
    deficits = router.policy.deficits
    assert (r.client, decode) not in deficits
    before = deficits[(r.client, prefill)]
    router.finish(r, 1.0)
    assert deficits[(r.client, prefill)] <= before  # output charged there at the finish
    assert not router.policy.active.get(decode)


def test_a_withdrawn_decode_stage_is_charged_as_finished() -> None:
    router = split_router("d2lpm", window=1)
    router.worker_down(D1, 0.0)
    held = req(9, client="y")
    router.route(held, 0.0)
    router.prefilled(held, 0.1)  # occupies its decode worker's one slot
    r = req(1, client="x")
    prefill = router.route(r, 0.2).decision.worker
    assert router.prefilled(r, 0.3).decode == D0
    assert not router.is_released(r)  # behind the other one in D0's window
    assert router.withdraw(r, 0.4)
    assert (r.client, prefill) in router.policy.deficits


def test_roles_parse_and_refuse_what_is_not_one() -> None:
    router = split_router()
    assert router.view.workers[D0].role == Role.DECODE
    with pytest.raises(ValueError, match="not a valid Role"):
        router.add_worker(9, role="encode")


def test_split_model_groups_route_apart() -> None:
    router = Router(
        policies.global_policies.build("least_load", {}, 0),
        lambda: policies.local_policies.build("fcfs", {}, 0),
        RouterConfig(block_size=BS),
    )
    for wid, model, role in ((0, "a", "prefill"), (1, "a", "decode"), (2, "b", "mixed")):
        router.add_worker(wid, model=model, role=role)
    ra = Request(1, 0.0, 65, 4, [1, 2, 3, 4], model="a")
    assert router.route(ra, 0.0).decision.worker == 0
    assert router.prefilled(ra, 0.1).decode == 1
    rb = Request(2, 0.0, 65, 4, [5, 6, 7, 8], model="b")
    assert router.route(rb, 0.0).decision.worker == 2
    with pytest.raises(UnknownModel):
        router.route(Request(3, 0.0, 65, 4, [], model="c"), 0.0)
    assert router.pools.models() == ["a", "b"]


def test_a_handoff_leaves_out_the_decode_workers_that_failed_it() -> None:
    router = split_router()
    r = req(1)
    router.route(r, 0.0)
    assert router.prefilled(r, 0.1, exclude=[D0]).decode == D1
    router.finish(r, 0.2)
    again = req(2)
    router.route(again, 0.3)
    handoff = router.prefilled(again, 0.4, exclude=[D0, D1])
    assert handoff.decode is None  # every decode worker failed it: it ends
