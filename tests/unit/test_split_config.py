"""Split fleets in cluster.yaml and on `fairway serve`'s command line: roles per worker group,
the KV connector, what each server is started with; every error names its field, before
anything starts. And the bodies each stage is sent (router/proxy/split.py)."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest
import yaml

from router.cli import build_parser
from router.cli.serve import serve_config
from router.proxy.service.config import validate_config
from router.proxy.service.serve import add_workers, build_cluster
from router.proxy.split import REMOTE_DECODE, client_body, decode_body, prefill_answer, prefill_body
from router.traits import Role
from tests.unit.test_config import EXAMPLE
from workers.launch import running_workers, server_specs

M, P, D = Role.MIXED, Role.PREFILL, Role.DECODE


@pytest.mark.parametrize(
    "workers, field",
    [
        ({"prefill": 1}, "workers.decode"),  # one worker with a role: nowhere to decode
        ({"prefill": 2}, "workers.decode"),
        ({"decode": 2}, "workers.prefill"),
        ({"count": 2, "decode": 1}, "workers.prefill"),  # mixed workers never hand off
        ({"count": 0}, "workers.count"),
        ({"prefill": 200, "decode": 100}, "workers.count"),
        ({"prefill": -1, "decode": 1}, "workers.prefill"),
        ({"urls": ["http://10.0.0.5:8000"], "prefill": 1, "decode": 1}, "workers.prefill"),
        ({"urls": ["http://10.0.0.5:8000"], "roles": ["prefill", "decode"]}, "workers.roles"),
        ({"urls": ["http://10.0.0.5:8000"], "roles": ["prefill"]}, "workers.roles"),
        ({"urls": ["http://a:1", "http://b:1"], "roles": ["decode", "mixed"]}, "workers.roles"),
        ({"urls": ["http://10.0.0.5:8000"], "roles": ["encode"]}, "workers.roles.0"),
        ({"roles": ["prefill", "decode"]}, "workers.roles"),
        ({"count": 2, "kv_connector": {"shape": "handshake"}}, "workers.kv_connector"),
        ({"prefill": 1, "decode": 1, "kv_connector": {"shape": "p2p"}},
         "workers.kv_connector.shape"),
        ({"prefill": 1, "decode": 1, "kv_connector": {"name": ""}}, "workers.kv_connector.name"),
        ({"prefill": 1, "decode": 1, "kv_connector": {"ttl": 3}}, "workers.kv_connector.ttl"),
    ],
)  # fmt: skip
def test_errors_name_the_field(workers: dict, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{field}: ")):
        validate_config({"workers": workers})


def test_a_model_groups_roles_are_checked_in_the_group() -> None:
    models = [{"served_model_name": "a", "workers": {"prefill": 1, "decode": 1}},
              {"served_model_name": "b", "workers": {"decode": 1, "first_port": 9000}}]  # fmt: skip
    with pytest.raises(ValueError, match=r"models\.1\.workers\.prefill: "):
        validate_config({"models": models})


def test_every_role_takes_its_ports_in_the_overlap_check() -> None:
    models = [{"served_model_name": "a", "workers": {"count": 1, "prefill": 1, "decode": 1}},
              {"served_model_name": "b", "workers": {"first_port": 8102}}]  # fmt: skip
    with pytest.raises(ValueError, match=r"models\.1\.workers\.first_port: port 8102"):
        validate_config({"models": models})


class TestRoles:
    def test_prefill_and_decode_alone_are_the_whole_fleet(self) -> None:
        w = validate_config({"workers": {"prefill": 2, "decode": 1}}).workers
        assert w.count == 0 and w.server_roles == [P, P, D] and w.is_split
        assert w.connector.shape == "handshake" and w.connector.connector == "nixl"

    def test_count_adds_mixed_workers_first(self) -> None:
        w = validate_config({"workers": {"count": 1, "prefill": 1, "decode": 2}}).workers
        assert w.server_roles == [M, P, D, D] and w.num_servers == 4

    def test_a_mixed_fleet_is_as_it_was(self) -> None:
        w = validate_config({}).workers
        assert w.server_roles == [M, M] and not w.is_split and w.kv_connector is None

    def test_urls_take_their_roles_in_order(self) -> None:
        urls = ["http://a:1", "http://b:1", "http://c:1"]
        w = validate_config({"workers": {"urls": urls, "roles": ["prefill", "decode", "mixed"]}})
        assert w.workers.server_roles == [P, D, M] and w.workers.num_servers == 0
        assert validate_config({"workers": {"urls": urls}}).workers.server_roles == [M, M, M]

    def test_a_shared_connector_defaults_to_vllms_example_connector(self) -> None:
        raw = {"prefill": 1, "decode": 1, "kv_connector": {"shape": "shared"}}
        assert validate_config({"workers": raw}).workers.connector.connector == "example"

    def test_the_examples_split_lines_are_valid(self) -> None:
        """The commented split fleet in workers/cluster.example.yaml, uncommented."""
        keys = ("prefill:", "decode:", "kv_connector:", "emulated_topology:")
        lines = [line.strip()[2:] for line in EXAMPLE.read_text().splitlines()
                 if line.strip().startswith(tuple(f"# {k}" for k in keys))]  # fmt: skip
        assert len(lines) == len(keys), lines
        raw = yaml.safe_load(EXAMPLE.read_text())
        raw["workers"].update(yaml.safe_load("\n".join(lines)))
        w = validate_config(raw).workers
        assert w.server_roles == [M, M, P, P, D, D] and w.connector.connector == "nixl"


def serve(*argv: str):
    return serve_config(build_parser().parse_args(["serve", *argv]))


class TestCommandLine:
    def test_prefill_and_decode_flags_make_a_split_fleet(self) -> None:
        w = serve("--prefill-workers", "2", "--decode-workers", "1").workers
        assert w.server_roles == [P, P, D]
        w = serve("--workers", "1", "--prefill-workers", "1", "--decode-workers", "1").workers
        assert w.server_roles == [M, P, D]

    def test_workers_stays_mixed(self) -> None:
        assert serve("--workers", "3").workers.server_roles == [M, M, M]

    def test_the_flags_override_a_config(self, tmp_path: Path) -> None:
        path = tmp_path / "cluster.yaml"
        path.write_text(yaml.safe_dump({"workers": {"count": 4, "first_port": 9100}}))
        w = serve("--config", str(path), "--prefill-workers", "1", "--decode-workers", "2").workers
        assert w.server_roles == [P, D, D] and w.first_port == 9100

    def test_a_bad_split_is_refused_naming_the_field(self) -> None:
        with pytest.raises(ValueError, match=r"workers\.decode: "):
            serve("--prefill-workers", "2")


class TestLaunch:
    def test_emulated_servers_get_their_role_network_and_port(self, tmp_path: Path) -> None:
        config = validate_config(
            {"workers": {"count": 1, "prefill": 1, "decode": 1, "first_port": 9100}}
        )
        specs = server_specs(config, tmp_path, tmp_path)
        assert [s.port for s in specs] == [9100, 9101, 9102]
        for i, (spec, role) in enumerate(zip(specs, ("mixed", "prefill", "decode"), strict=True)):
            argv = spec.argv
            assert argv[argv.index("--role") + 1] == role
            assert argv[argv.index("--topology-gpu") + 1] == str(i)
            assert argv[argv.index("--topology-gpus") + 1] == "3"
            assert argv[argv.index("--topology") + 1] == "dgx-h100"
            assert "--kv-shared-dir" not in argv

    def test_a_shared_emulated_fleet_shares_one_folder(self, tmp_path: Path) -> None:
        raw = {"prefill": 1, "decode": 1, "kv_connector": {"shape": "shared"}}
        specs = server_specs(validate_config({"workers": raw}), tmp_path, tmp_path)
        folders = {s.argv[s.argv.index("--kv-shared-dir") + 1] for s in specs}
        assert len(folders) == 1 and Path(folders.pop()).is_dir()

    def test_vllm_servers_get_their_connector(self, tmp_path: Path) -> None:
        connector = {"extra_config": {"kv_lease_duration": 60}}
        raw = {"backend": "vllm", "vllm_python": "/bin/true", "count": 1, "prefill": 1,
               "decode": 1, "kv_connector": connector}  # fmt: skip
        specs = server_specs(validate_config({"workers": raw}), tmp_path, tmp_path)
        mixed, prefill, decode = specs
        assert "--kv-transfer-config" not in mixed.argv
        for spec, kv_role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
            transfer = yaml.safe_load(spec.argv[spec.argv.index("--kv-transfer-config") + 1])
            assert transfer["kv_connector"] == "NixlConnector"
            assert transfer["kv_role"] == kv_role
            assert transfer["kv_connector_extra_config"] == {"kv_lease_duration": 60}
        ports = {s.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for s in (prefill, decode)}
        assert len(ports) == 2, "each server its own side channel"

    @pytest.mark.parametrize(
        "raw, field",
        [
            ({"backend": "vllm", "kv_connector": {"name": "mooncake"}},
             "workers.kv_connector.name"),
            ({"backend": "vllm", "kv_connector": {"shape": "shared", "name": "nixl"}},
             "workers.kv_connector.shape"),
            ({"emulated_topology": "token-ring"}, "workers.emulated_topology"),
        ],
    )  # fmt: skip
    def test_launch_errors_name_the_field(self, tmp_path: Path, raw: dict, field: str) -> None:
        raw = {"vllm_python": "/bin/true", "prefill": 1, "decode": 1, **raw}
        with pytest.raises(ValueError, match=re.escape(f"{field}: ")):
            server_specs(validate_config({"workers": raw}), tmp_path, tmp_path)

    def test_running_servers_reach_the_router_with_their_roles(self, tmp_path: Path) -> None:
        urls = ["http://127.0.0.1:9100", "http://127.0.0.1:9101", "http://127.0.0.1:9102"]
        raw = {"urls": urls, "roles": ["prefill", "decode", "mixed"],
               "kv_connector": {"shape": "shared"}}  # fmt: skip
        config = validate_config({"workers": raw})
        with running_workers(config, tmp_path, on_lost=lambda _: None) as workers:
            assert [(w.role, w.kv_shape) for w in workers] == [
                ("prefill", "shared"), ("decode", "shared"), ("mixed", "shared")
            ]  # fmt: skip
            cluster = build_cluster(config)
            add_workers(cluster, workers)
        assert [w.role for w in cluster.workers.values()] == [P, D, M]
        assert cluster.view.workers[1].role == "decode"


class TestProtocol:
    BODY = {"model": "tiny", "messages": [], "max_completion_tokens": 50, "max_tokens": 50,
            "min_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0}  # fmt: skip

    def test_the_prefill_computes_the_prompt_and_one_token_unstreamed(self) -> None:
        body = prefill_body(self.BODY, "handshake")
        assert body == {"model": "tiny", "messages": [], "max_completion_tokens": 1,
                        "max_tokens": 1, "stream": False, "temperature": 0,
                        "kv_transfer_params": REMOTE_DECODE}  # fmt: skip
        assert "kv_transfer_params" not in prefill_body(self.BODY, "shared")
        assert self.BODY["max_tokens"] == 50, "the client's body is left as it was"

    def test_the_decode_gets_the_clients_body_and_the_prefills_parameters(self) -> None:
        params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "h"}
        usage = {"completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 256}}
        answer = orjson.dumps({"kv_transfer_params": params, "usage": usage})
        assert prefill_answer(answer, "handshake") == (params, 256)
        assert decode_body(self.BODY, params) == {**self.BODY, "kv_transfer_params": params}
        assert decode_body(self.BODY, None) is self.BODY
        # vLLM answers `"kv_transfer_params": null` without a connector; shared: none needed.
        assert prefill_answer(b'{"kv_transfer_params": null, "usage": {}}', "handshake") == (
            None, None
        )  # fmt: skip
        assert prefill_answer(answer, "shared") == (None, 256)
        assert prefill_answer(b"not json", "handshake") == (None, None)

    def test_a_clients_transfer_parameters_are_dropped(self) -> None:
        hostile = {**self.BODY, "kv_transfer_params": {"remote_host": "203.0.113.7"},
                   "ec_transfer_params": {"x": 1}}  # fmt: skip
        assert client_body(hostile) == self.BODY
        assert client_body(self.BODY) is self.BODY
