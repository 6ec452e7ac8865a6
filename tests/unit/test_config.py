"""cluster.yaml: validated on load, errors name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.proxy.fleet.config import load_config, validate_config

EXAMPLE = Path(__file__).resolve().parents[2] / "workers" / "cluster.example.yaml"


def test_the_example_config_is_valid() -> None:
    config = load_config(EXAMPLE)
    assert config.policy.name == "d2lpm" and config.workers.count == 2


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"workers": {"count": 0}}, "workers.count"),
        ({"workers": {"backend": "tgi"}}, "workers.backend"),
        ({"policy": {"name": "fastest"}}, "policy.name"),
        ({"policy": {"local": "lifo"}}, "policy.local"),
        ({"window": 0}, "window"),
        ({"index_mode": "psychic"}, "index_mode"),
        ({"colour": "blue"}, "colour"),
        ({"timeouts": {"queue": -1}}, "timeouts.queue"),
        ({"cost_profile": "/nonexistent/profile.json"}, "cost_profile"),
        ({"cost_preset": "gpt-9"}, "cost_preset"),
        ({"workers": {"emulated_gpu": "tpu"}}, "workers.emulated_gpu"),
    ],
)
def test_errors_name_the_field(raw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"{field}: "):
        validate_config(raw)


def test_bad_yaml_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "c.yaml"
    bad.write_text("workers: [unclosed\n")
    with pytest.raises(ValueError, match="cannot read config"):
        load_config(bad)


def test_a_profile_prices_the_live_policies(tmp_path: Path) -> None:
    from router.cost_model import FittedCost
    from router.proxy.fleet.serve import build_cluster

    terms = dict.fromkeys(FittedCost.COEFFICIENTS, 0.001)
    FittedCost(terms, 50_000, "fitted:tiny").save(tmp_path / "p.json")
    profile = str(tmp_path / "p.json")
    config = validate_config({"policy": {"name": "preble"}, "cost_profile": profile})
    assert build_cluster(config).view.cost.name == "fitted:tiny"
