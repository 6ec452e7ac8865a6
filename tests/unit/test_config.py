"""cluster.yaml: validated on load, errors name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from router.proxy.service.config import load_config, validate_config

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
    from router.proxy.service.serve import build_cluster

    terms = dict.fromkeys(FittedCost.COEFFICIENTS, 0.001)
    FittedCost(terms, 50_000, "fitted:tiny").save(tmp_path / "p.json")
    profile = str(tmp_path / "p.json")
    config = validate_config({"policy": {"name": "preble"}, "cost_profile": profile})
    assert build_cluster(config).view.cost.name == "fitted:tiny"


class TestSecrets:
    """Keys, the admin token and the client salt: in the file, or named by `_env` / `_file`
    (exactly one form); never shown by a repr, a str or a plain dump."""

    KEY = "sk-live-SECRETabcd1234"

    def tenant(self, **key) -> dict:
        return {"tenants": [{"client": "team-a", **key}]}

    def test_each_form_reads_the_same_key(self, tmp_path: Path, monkeypatch) -> None:
        monkeypatch.setenv("TEAM_A_KEY", self.KEY)
        (tmp_path / "key").write_text(self.KEY + "\n")
        forms = [
            {"api_key": self.KEY},
            {"api_key_env": "TEAM_A_KEY"},
            {"api_key_file": str(tmp_path / "key")},
        ]
        for form in forms:
            config = validate_config(self.tenant(**form))
            assert config.tenants[0].api_key.get_secret_value() == self.KEY, form

    @pytest.mark.parametrize(
        "form, field",
        [
            ({"api_key_env": "FAIRWAY_TEST_UNSET"}, "api_key_env"),
            ({"api_key_file": "/nonexistent/key"}, "api_key_file"),
            ({"api_key": KEY, "api_key_env": "X"}, "api_key and api_key_env"),
            ({}, "api_key"),
            ({"api_key": "short"}, "api_key"),
        ],
    )
    def test_a_missing_or_doubled_key_names_the_field(self, form: dict, field: str) -> None:
        with pytest.raises(ValueError, match=rf"tenants\.0.*{field}: ") as error:
            validate_config(self.tenant(**form))
        assert self.KEY not in str(error.value), "the error never shows the key"

    def test_admin_token_and_salt_from_env_and_file(self, tmp_path: Path, monkeypatch) -> None:
        monkeypatch.setenv("FAIRWAY_ADMIN", "admin-token-5678")
        (tmp_path / "salt").write_text("pepper\n")
        config = validate_config(
            {"admin_token_env": "FAIRWAY_ADMIN", "client_salt_file": str(tmp_path / "salt")}
        )
        assert config.admin_token is not None and config.client_salt is not None
        assert config.admin_token.get_secret_value() == "admin-token-5678"
        assert config.client_salt.get_secret_value() == "pepper"
        with pytest.raises(ValueError, match="admin_token_env: the environment variable"):
            validate_config({"admin_token_env": "FAIRWAY_TEST_UNSET"})
        with pytest.raises(ValueError, match="admin_token and admin_token_file: "):
            validate_config({"admin_token": "x" * 12, "admin_token_file": str(tmp_path / "salt")})

    def test_no_repr_str_or_dump_shows_a_secret(self) -> None:
        config = validate_config(
            {**self.tenant(api_key=self.KEY), "admin_token": "admin-token-5678"}
        ).with_salt()
        salt = config.client_salt.get_secret_value()  # type: ignore[union-attr]
        shown = [repr(config), str(config), str(config.model_dump()), str(config.model_dump_json())]
        for text in shown:
            for secret in (self.KEY, "admin-token-5678", salt):
                assert secret not in text, (secret, text[:200])

    def test_a_replica_gets_the_secrets_and_the_salt_in_clear(self) -> None:
        config = validate_config(
            {**self.tenant(api_key=self.KEY), "admin_token": "admin-token-5678"}
        ).with_salt()
        assert config.with_salt() is config, "drawn once"
        again = validate_config(config.with_secrets())
        assert again == config
        assert again.tenants[0].api_key.get_secret_value() == self.KEY

    def test_cli_overrides_keep_the_secrets(self, tmp_path: Path) -> None:
        path = tmp_path / "c.yaml"
        path.write_text(f"tenants: [{{api_key: {self.KEY}, client: a}}]\nadmin_token: tok-12345\n")
        config = load_config(path, port=9100)
        again = validate_config({**config.model_dump(), "workers": {"count": 1}})
        assert again.tenants[0].api_key.get_secret_value() == self.KEY
        assert again.admin_token is not None and again.admin_token.get_secret_value() == "tok-12345"


class TestAdminListener:
    def test_the_admin_port_defaults_to_the_port_after_port(self) -> None:
        assert validate_config({"port": 9000}).admin_ports == [9001]
        assert validate_config({"port": 9000, "routers": 3}).admin_ports == [9001, 9002, 9003]
        assert validate_config({"port": 9000, "admin_port": 7000}).admin_ports == [7000]
        config = validate_config({"port": 9000, "routers": 2, "replica_ports": [7001, 7005]})
        assert config.admin_ports == [7001, 7005] and config.admin_host == "127.0.0.1"

    @pytest.mark.parametrize(
        "raw",
        [
            {"port": 9000, "admin_port": 9000},
            {"port": 9002, "admin_port": 9000, "routers": 3},
            {"port": 65535},
            {"admin_port": 7000, "routers": 2, "replica_ports": [7001, 7002]},
        ],
    )
    def test_an_admin_port_needs_a_port_of_its_own(self, raw: dict) -> None:
        with pytest.raises(ValueError, match="admin_port"):
            validate_config(raw)

    def test_client_labels_is_a_count_or_names(self) -> None:
        assert validate_config({"limits": {"client_labels": 3}}).limits.client_labels == 3
        named = validate_config({"limits": {"client_labels": ["alice", "team-x"]}})
        assert named.limits.client_labels == ["alice", "team-x"]
        for bad in (-1, [""], "alice"):
            with pytest.raises(ValueError, match="limits.client_labels"):
                validate_config({"limits": {"client_labels": bad}})


def test_the_example_models_block_is_valid(tmp_path: Path) -> None:
    """The commented `models:` block of the example, in place of its one model."""
    text = EXAMPLE.read_text()
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# models:"))
    adapter = tmp_path / "support-bot"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    block = "\n".join(line[2:] for line in lines[start:])
    raw = yaml.safe_load(text)
    for field in ("model", "served_model_name", "max_model_len", "workers"):
        raw.pop(field, None)
    raw.update(yaml.safe_load(block.replace("/adapters/support-bot", str(adapter))))
    config = validate_config(raw)
    assert [g.served_model_name for g in config.groups] == ["llama", "qwen"]
    assert config.groups[0].adapters[0].path == str(adapter)


def test_one_model_is_one_group() -> None:
    (group,) = validate_config({"served_model_name": "m", "workers": {"count": 3}}).groups
    assert group.served_model_name == "m" and group.workers.count == 3 and not group.adapters


@pytest.mark.parametrize(
    "models, message",
    [
        ([{"served_model_name": "a"}, {"served_model_name": "a", "workers": {"first_port": 9000}}],
         "models.1: the name 'a' is served twice"),
        ([{"served_model_name": "a"}, {"served_model_name": "b"}],
         "models.1.workers.first_port: port 8100 is models.0's"),
        ([{"served_model_name": "a", "adapters": [{"name": "x", "path": "/nonexistent"}]}],
         "models.0.adapters.0.path"),
        ([{"served_model_name": "a", "adapters": [{"name": "a", "path": "."}]}],
         "models.0.adapters.0.path"),
    ],
)  # fmt: skip
def test_model_group_errors_name_the_field(models: list, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        validate_config({"models": models})


def test_models_exclude_the_one_model_fields() -> None:
    with pytest.raises(ValueError, match="models: give served_model_name inside each group"):
        validate_config({"served_model_name": "x", "models": [{"served_model_name": "a"}]})
