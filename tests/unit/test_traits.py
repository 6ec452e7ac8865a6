"""Speed hints and modes (router/traits.py), and parameters objects in the registry."""

from __future__ import annotations

import pytest

import policies
from policies.service_cost import LinearCost
from policies.service_params import ServiceCostParams
from router.bands import Banded
from router.policy import GlobalPolicy, LocalPolicy, overridden_hook
from router.traits import (
    DisciplineTraits,
    IndexLevel,
    IndexMode,
    Placement,
    PolicyTraits,
    ReordersOn,
)
from simulator.config import SimConfig


class TestTraits:
    def test_a_policy_that_declares_nothing_skips_nothing(self) -> None:
        assert GlobalPolicy.traits == PolicyTraits(
            counts_tokens=True, tokens_read_at_finish=False, reads_prefixes=True
        )
        assert LocalPolicy.traits == DisciplineTraits(True, ReordersOn.TOKENS)

    @pytest.mark.parametrize(
        "name, counts, reorders",
        [
            ("fcfs", False, ReordersOn.NOTHING),
            ("lpm", False, ReordersOn.CACHE),
            ("preble", False, ReordersOn.CACHE),
            ("vtc", True, ReordersOn.TOKENS),
            ("lcf", True, ReordersOn.TOKENS),
            ("dlpm", True, ReordersOn.TOKENS),
        ],
    )
    def test_disciplines_declare_what_they_are(self, name, counts, reorders) -> None:
        traits = policies.local_policies.get(name).traits
        assert (traits.counts_tokens, traits.reorders_on) == (counts, reorders)

    @pytest.mark.parametrize("name", policies.global_policies.names())
    def test_a_global_policy_counts_tokens_exactly_when_it_has_a_token_hook(self, name) -> None:
        cls = policies.global_policies.get(name)
        hooked = cls.on_token is not GlobalPolicy.on_token
        assert cls.traits.counts_tokens == hooked, name

    def test_a_class_that_says_it_counts_no_tokens_may_not_define_a_token_hook(self) -> None:
        with pytest.raises(TypeError, match="counts_tokens=False"):

            class Wrong(LocalPolicy):
                traits = DisciplineTraits(counts_tokens=False)

                def on_tokens(self, requests, num_tokens) -> None:
                    pass

        with pytest.raises(TypeError, match="counts_tokens=False"):

            class AlsoWrong(policies.global_policies.get("least_load")):
                def on_token(self, request, worker, num_tokens, now) -> None:
                    pass

    def test_the_router_skips_only_hooks_that_do_nothing(self) -> None:
        least_load = policies.global_policies.get("least_load")

        class Told(least_load):
            def on_finish(self, request, worker, view) -> None:
                pass

        plain, told = least_load(), Told()
        assert overridden_hook(plain, "on_dispatch") is None
        assert overridden_hook(plain, "on_finish") is None
        assert overridden_hook(told, "on_finish") == told.on_finish
        # GlobalPolicy's on_withdraw tells on_finish: never skipped.
        assert overridden_hook(plain, "on_withdraw") == plain.on_withdraw
        vtc = policies.global_policies.build("vtc", {}, 0)
        preble = policies.global_policies.build("preble", {}, 0)
        assert overridden_hook(preble, "on_dispatch") is not None
        assert overridden_hook(vtc, "on_first_token") is None
        # A discipline's: FCFS keeps LocalPolicy's no-op on_finish, VTC's and bands' act.
        local = policies.local_policies
        assert overridden_hook(local.build("fcfs", {}, 0), "on_finish") is None
        vtc_queue = local.build("vtc", {}, 0)
        assert overridden_hook(vtc_queue, "on_finish") == vtc_queue.on_finish
        bands = Banded(local.get("fcfs"), [0, 10])
        assert overridden_hook(bands, "on_finish") == bands.on_finish
        assert overridden_hook(vtc_queue, "on_token") == vtc_queue.on_token

    def test_reorders_on_is_taken_from_its_string(self) -> None:
        assert DisciplineTraits(reorders_on="cache").reorders_on is ReordersOn.CACHE
        with pytest.raises(ValueError):
            DisciplineTraits(reorders_on="sometimes")


class TestModes:
    def test_a_mode_is_the_string_users_type(self) -> None:
        assert IndexMode.PRECISE == "precise" and {"precise": 1}[IndexMode.PRECISE] == 1
        assert f"{Placement.ROUTER}" == str(Placement.ROUTER) == "router"
        assert [str(level) for level in IndexLevel] == ["precise", "approximate", "load"]

    def test_sim_config_takes_strings_and_keeps_its_messages(self) -> None:
        config = SimConfig(index="precise", placement="router")
        assert config.index is IndexMode.PRECISE and config.placement is Placement.ROUTER
        with pytest.raises(ValueError, match=r"index: 'approximate' or 'precise', got 'exact'"):
            SimConfig(index="exact")
        with pytest.raises(ValueError, match=r"placement: 'engine' or 'router', got 'gpu'"):
            SimConfig(placement="gpu")


class TestParametersObject:
    @pytest.mark.parametrize(
        "registry, name", [("local", "vtc"), ("local", "dlpm"), ("global", "d2lpm")]
    )
    def test_users_name_the_fields_and_the_policy_gets_the_object(self, registry, name) -> None:
        reg = policies.local_policies if registry == "local" else policies.global_policies
        built = reg.build(name, {"w_out": 3, "charge_output": "predicted"})
        created = reg.create(name, w_out=3.0, charge_output="predicted")
        whole = reg.create(
            name, service_cost=ServiceCostParams(w_out=3.0, charge_output="predicted")
        )
        for policy in (built, created, whole):
            assert policy.meter.cost == LinearCost(1.0, 3.0) and policy.meter.is_predicted

    def test_an_unknown_name_lists_the_fields_among_the_parameters(self) -> None:
        with pytest.raises(ValueError) as e:
            policies.local_policies.build("dlpm", {"service_cost": {}})
        assert str(e.value) == (
            "local policy 'dlpm' takes no parameter ['service_cost']; it takes ['charge_output', "
            "'cost', 'cost_coeffs', 'max_scan', 'predict_window', 'quantum', 'w_in', 'w_out']"
        )

    def test_a_bad_field_value_names_it(self) -> None:
        with pytest.raises(ValueError, match=r"parameter 'w_in'='x'"):
            policies.local_policies.build("vtc", {"w_in": "x"})
        with pytest.raises(ValueError, match=r"^cost: one of linear, profiled, got 'cubic'$"):
            policies.local_policies.build("vtc", {"cost": "cubic"})
