"""D²LPM's quantum: the user's exactly, or one that follows the dispatch charges; DLPM's
local quantum keeps its fixed default."""

from __future__ import annotations

import pytest

import policies
from policies.quantum import FLOOR, WINDOW, Quantum
from tests.helpers import BS, make_req, make_view


class TestQuantum:
    def test_a_given_quantum_is_kept_whatever_is_charged(self) -> None:
        q = Quantum(300.0)
        for charge in (10.0, 1e6, 5.0):
            q.observe(charge)
            assert q.value == 300.0

    @pytest.mark.parametrize("bad", [0.0, -1.0])
    def test_a_quantum_must_be_positive(self, bad: float) -> None:
        with pytest.raises(ValueError, match="quantum: must be positive"):
            Quantum(bad)

    def test_starts_at_the_floor_and_never_goes_below(self) -> None:
        q = Quantum()
        assert q.value == FLOOR
        q.observe(FLOOR / 4)
        assert q.value == FLOOR

    def test_follows_the_largest_charge_in_the_window(self) -> None:
        q = Quantum()
        q.observe(5000.0)
        q.observe(3000.0)
        assert q.value == 5000.0
        for _ in range(WINDOW - 2):
            q.observe(10.0)
        assert q.value == 5000.0, "still one of the last WINDOW charges"
        q.observe(10.0)
        assert q.value == 3000.0, "5000 left the window; 3000 is the largest in it"
        q.observe(10.0)
        assert q.value == FLOOR

    def test_the_window_maximum_matches_a_scan(self) -> None:
        q = Quantum(floor=0.0, window=7)
        charges = [float((i * 7919) % 1000) for i in range(200)]
        for i, charge in enumerate(charges):
            q.observe(charge)
            assert q.value == max(charges[max(0, i - 6) : i + 1])


class TestPoliciesAdapt:
    def test_d2lpm_follows_its_dispatch_charges_dlpm_keeps_its_default(self) -> None:
        big = make_req(1, list(range(400)), "a", tail=0)  # 6,400 tokens, none cached
        d2 = policies.global_policies.create("d2lpm")
        assert d2.quantum == FLOOR
        d2.on_dispatch(big, 0, make_view(0, 0))
        assert d2.quantum == big.prompt_len
        q = policies.local_policies.create("dlpm")
        q.push(big)
        q.pop(big, 0)
        assert q.quantum == 2048

    def test_an_explicit_quantum_wins(self) -> None:
        big = make_req(1, list(range(400)), "a", tail=0)
        d2 = policies.global_policies.build("d2lpm", {"quantum": 2048})
        d2.on_dispatch(big, 0, make_view(0, 0))
        assert d2.quantum == 2048
        q = policies.local_policies.build("dlpm", {"quantum": 4096})
        q.push(big)
        q.pop(big, 0)
        assert q.quantum == 4096

    def test_d2lpm_keeps_a_client_with_long_turns_at_its_holder(self) -> None:
        """Turns whose extend tokens each cost more than 2,048: with the old fixed quantum the
        client is in deficit at the holder after one turn and is sent to the shortest queue;
        the adapted quantum, grown on such charges before, covers a turn, so the next turn
        stays where its prefix is."""
        prefix = list(range(1, 2001))  # 32k tokens held by worker 0

        def turn(i: int, client: str = "a"):  # the prefix and 200 blocks of its own
            return make_req(i, prefix + list(range(5000 + 200 * i, 5200 + 200 * i)), client)

        def second_turn_worker(policy) -> int:
            view = make_view(1, 0)  # worker 1 has the shorter queue
            view.index.insert(prefix, 0, now=0.0)
            policy.on_dispatch(turn(0, "b"), 1, view)  # an earlier miss on such a prompt
            policy.active[0] = {"other": 1}
            policy.deficits[("other", 0)] = 1.0  # another tenant in credit there: no refill
            for i in (1, 2):
                worker = policy.route(turn(i), view).worker
                policy.on_dispatch(turn(i), worker, view)
            return worker

        # Each turn adds 200 new blocks (3,208 tokens): more than 2,048.
        assert second_turn_worker(policies.global_policies.create("d2lpm", quantum=2048)) == 1
        adapted = policies.global_policies.create("d2lpm")
        assert second_turn_worker(adapted) == 0
        assert adapted.quantum == turn(0).prompt_len  # b's whole prompt was a miss
        assert adapted.quantum >= 200 * BS
