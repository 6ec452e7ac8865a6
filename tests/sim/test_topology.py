"""The cluster network (simulator/topology.py) and the transfers over it (simulator/transfers.py):
paths and transfer times on a hand-built graph, links shared max-min fairly by concurrent KV
transfers, the presets, the YAML form's errors, and the issue's KV arithmetic."""

from __future__ import annotations

import random
import time
from pathlib import Path

import networkx as nx
import pytest
import simpy

from router.cost_model import MODELS
from simulator.topology import GBPS, PRESETS, Topology, kv_bytes
from simulator.transfers import KVTransfers, fair_rates

NV, NV_LAT = 450e9, 1e-6  # bytes/s each way, s per hop
IB, IB_LAT = 50e9, 4e-6
GB = 1e9


def two_by_two() -> Topology:
    """2 hosts x 2 GPUs: GPUs 0, 1 on host switch h0 and 2, 3 on h1 (NVLink), h0 -- h1 (IB)."""
    g = nx.Graph()
    for gpu, host in [(0, "h0"), (1, "h0"), (2, "h1"), (3, "h1")]:
        g.add_edge(gpu, host, bandwidth=NV, latency=NV_LAT)
    g.add_edge("h0", "h1", bandwidth=IB, latency=IB_LAT)
    return Topology(g)


def finish_times(topology: Topology, *sends: tuple[float, int, int, float]) -> list[float]:
    """Run `(at, src, dst, nbytes)` transfers to the end; each one's arrival time, in order."""
    env = simpy.Environment()
    net = KVTransfers(env, topology)
    ends: list[float] = [-1.0] * len(sends)

    def start(i: int, at: float, src: int, dst: int, nbytes: float):
        yield env.timeout(at)
        done = yield net.send(src, dst, nbytes)
        assert done.end == env.now, "a transfer's event fires at its recorded end"
        ends[i] = env.now

    for i, send in enumerate(sends):
        env.process(start(i, *send))
    env.run()
    assert net.num_active == 0, "every flow finished"
    assert len(net.records) == len(sends), "one record per transfer"
    return ends


def assert_max_min_fair(paths: list[list[int]], capacity: dict[int, float], rates: list[float]):
    """The max-min fair characterisation: no link carries more than its capacity, and every flow
    crosses a full link on which no flow goes faster than it."""
    load = {link: 0.0 for link in capacity}
    for links, rate in zip(paths, rates, strict=True):
        assert rate > 0, f"a flow on {links} got no rate"
        for link in links:
            load[link] += rate
    for link, total in load.items():
        assert total <= capacity[link] * (1 + 1e-9), f"link {link} over capacity: {total}"
    for i, links in enumerate(paths):
        assert any(
            load[link] >= capacity[link] * (1 - 1e-9)
            and all(rates[j] <= rates[i] * (1 + 1e-9) for j, p in enumerate(paths) if link in p)
            for link in links
        ), f"flow {i} on {links} at {rates[i]} has no bottleneck link"


class TestPaths:
    def test_the_same_gpu_crosses_nothing_in_no_time(self) -> None:
        topo = two_by_two()
        assert topo.path(1, 1) == ()
        assert topo.transfer_time(1, 1, 10 * GB) == 0.0

    def test_same_host_goes_over_nvlink_alone(self) -> None:
        topo = two_by_two()
        assert [(k.src, k.dst) for k in topo.path(0, 1)] == [(0, "h0"), ("h0", 1)]
        assert topo.transfer_time(0, 1, 9 * GB) == pytest.approx(9 * GB / NV + 2 * NV_LAT)

    def test_cross_host_is_bound_by_the_inter_host_link(self) -> None:
        topo = two_by_two()
        assert [(k.src, k.dst) for k in topo.path(3, 0)] == [(3, "h1"), ("h1", "h0"), ("h0", 0)]
        expected = 5 * GB / IB + 2 * NV_LAT + IB_LAT
        assert topo.transfer_time(0, 2, 5 * GB) == pytest.approx(expected)
        assert topo.transfer_time(2, 0, 5 * GB) == pytest.approx(expected), "either direction"

    def test_each_direction_is_its_own_link(self) -> None:
        topo = two_by_two()
        there, back = topo.path(0, 2)[1], topo.path(2, 0)[1]
        assert (there.src, there.dst, back.src, back.dst) == ("h0", "h1", "h1", "h0")
        assert there.id != back.id and there.bandwidth == back.bandwidth == IB

    def test_the_least_latency_path_wins_over_fewer_hops(self) -> None:
        g = nx.Graph()
        g.add_edge(0, 1, bandwidth=IB, latency=10e-6)  # direct but slow to start
        g.add_edge(0, "s", bandwidth=NV, latency=1e-6)
        g.add_edge("s", 1, bandwidth=NV, latency=1e-6)
        assert [k.dst for k in Topology(g).path(0, 1)] == ["s", 1]

    def test_the_callers_graph_is_left_alone(self) -> None:
        g = nx.Graph()
        g.add_edge(0, "s", bandwidth=NV, latency=0.0)
        g.add_edge(1, "s", bandwidth=NV, latency=0.0)
        Topology(g)
        assert all("id" not in d for _, _, d in g.edges(data=True))

    @pytest.mark.parametrize(
        ("edges", "error"),
        [
            ([(0, "s", 1.0, 0.0), (2, "s", 1.0, 0.0)], "ints 0..N-1"),
            ([(0, "s", 0.0, 0.0), (1, "s", 1.0, 0.0)], "link 0->s: bandwidth must be > 0"),
            ([(0, "s", 1.0, -1.0), (1, "s", 1.0, 0.0)], "latency >= 0"),
        ],
    )
    def test_a_bad_graph_is_refused(self, edges: list[tuple], error: str) -> None:
        g = nx.Graph()
        for u, v, bw, lat in edges:
            g.add_edge(u, v, bandwidth=bw, latency=lat)
        with pytest.raises(ValueError, match=error):
            Topology(g)

    def test_unknown_or_unreachable_gpus_are_named(self) -> None:
        with pytest.raises(ValueError, match=r"GPU 4 is not in this topology \(0..3\)"):
            two_by_two().path(0, 4)
        g = nx.Graph()
        g.add_edge(0, "a", bandwidth=1.0, latency=0.0)
        g.add_edge(1, "b", bandwidth=1.0, latency=0.0)
        with pytest.raises(ValueError, match="no path from GPU 0 to GPU 1"):
            Topology(g).path(0, 1)


class TestContention:
    def test_one_transfer_alone_takes_its_transfer_time(self) -> None:
        topo = two_by_two()
        (end,) = finish_times(topo, (0.5, 0, 2, 2 * GB))
        assert end == pytest.approx(0.5 + topo.transfer_time(0, 2, 2 * GB), rel=1e-12)

    def test_the_same_gpu_and_zero_bytes_arrive_at_once_or_after_latency(self) -> None:
        same, empty = finish_times(two_by_two(), (1.0, 3, 3, GB), (1.0, 0, 2, 0))
        assert same == 1.0
        assert empty == pytest.approx(1.0 + 2 * NV_LAT + IB_LAT, rel=1e-12)

    def test_two_flows_on_the_inter_host_link_each_take_twice_as_long(self) -> None:
        topo = two_by_two()
        latency = 2 * NV_LAT + IB_LAT
        alone = topo.transfer_time(0, 2, 4 * GB) - latency
        a, b = finish_times(topo, (0.0, 0, 2, 4 * GB), (0.0, 1, 3, 4 * GB))
        assert a == b == pytest.approx(2 * alone + latency, rel=1e-12)

    def test_a_flow_on_a_disjoint_path_is_not_slowed(self) -> None:
        """2 -> 0 crosses h1 -> h0, the other direction of the link 0 -> 2 and 1 -> 3 share."""
        topo = two_by_two()
        _, _, back = finish_times(
            topo, (0.0, 0, 2, 4 * GB), (0.0, 1, 3, 4 * GB), (0.0, 2, 0, 4 * GB)
        )
        assert back == pytest.approx(topo.transfer_time(2, 0, 4 * GB), rel=1e-12)

    def test_a_flow_starting_while_another_runs(self) -> None:
        """A: 10 GB 0 -> 2 at t=0, at 50 GB/s; B: 10 GB 1 -> 3 at t=0.1. At 0.1 A has 5 GB
        left; both go at 25 GB/s, so A's bytes finish at 0.1 + 5/25 = 0.3; B then has 5 GB left,
        alone at 50 GB/s: done at 0.3 + 5/50 = 0.4. Each arrives the path's latency later."""
        latency = 2 * NV_LAT + IB_LAT
        a, b = finish_times(two_by_two(), (0.0, 0, 2, 10 * GB), (0.1, 1, 3, 10 * GB))
        assert a == pytest.approx(0.3 + latency, rel=1e-12)
        assert b == pytest.approx(0.4 + latency, rel=1e-12)

    def test_three_flows_on_two_links_of_different_bandwidth(self) -> None:
        """L1 (s1 -> s2) at 10 B/s, L2 (s2 -> s3) at 4 B/s, the rest fat. a: 0 -> 1 crosses L1;
        b: 0 -> 2 crosses L1 and L2; c: 3 -> 2 crosses L2. L2 is the bottleneck (4/2 = 2 < 10/2),
        so b = c = 2 and a takes what L1 has left, 8. b's 20 B finish at t=10; a has 160 - 80 =
        80 B left, then 10 B/s: t=18; c has 40 - 20 = 20 B left, then 4 B/s: t=15."""
        fat = 1000.0
        g = nx.Graph()
        g.add_edge(0, "s1", bandwidth=fat, latency=0.0)
        g.add_edge("s1", "s2", bandwidth=10.0, latency=0.0)
        g.add_edge("s2", 1, bandwidth=fat, latency=0.0)
        g.add_edge("s2", "s3", bandwidth=4.0, latency=0.0)
        g.add_edge("s3", 2, bandwidth=fat, latency=0.0)
        g.add_edge(3, "s2", bandwidth=fat, latency=0.0)
        a, b, c = finish_times(Topology(g), (0.0, 0, 1, 160), (0.0, 0, 2, 20), (0.0, 3, 2, 40))
        assert (a, b, c) == pytest.approx((18.0, 10.0, 15.0), rel=1e-12)

    def test_flows_on_one_path_share_it_and_the_shorter_leaves_first(self) -> None:
        """1 GB and 3 GB from GPU 0 to GPU 2 at t=0: 25 GB/s each; the 1 GB is done at 0.04; the
        3 GB then has 2 GB left at 50 GB/s: done at 0.08. Run again with a 1 GB from GPU 1 to 3
        sent at 0.04, the moment the first finishes: it and the 3 GB go at 25 GB/s, so it is done
        at 0.08, and the 3 GB (1 GB left then) at 0.08 + 1/50 = 0.1."""
        latency = 2 * NV_LAT + IB_LAT
        short, long_ = finish_times(two_by_two(), (0.0, 0, 2, 1 * GB), (0.0, 0, 2, 3 * GB))
        assert (short, long_) == pytest.approx((0.04 + latency, 0.08 + latency), rel=1e-12)
        short, long_, late = finish_times(
            two_by_two(), (0.0, 0, 2, 1 * GB), (0.0, 0, 2, 3 * GB), (0.04, 1, 3, 1 * GB)
        )
        assert (short, long_, late) == pytest.approx(
            (0.04 + latency, 0.1 + latency, 0.08 + latency), rel=1e-12
        )

    def test_records_hold_each_transfer(self) -> None:
        env = simpy.Environment()
        net = KVTransfers(env, two_by_two())
        net.send(0, 1, 45 * GB)
        env.run()
        (record,) = net.records
        assert record[:4] == (0, 1, 45 * GB, 0.0)
        assert record.end == pytest.approx(0.1 + 2 * NV_LAT, rel=1e-12)

    def test_negative_bytes_are_refused(self) -> None:
        with pytest.raises(ValueError, match="nbytes must be >= 0"):
            KVTransfers(simpy.Environment(), two_by_two()).send(0, 1, -1)

    def test_thousands_of_transfers_are_fast_and_never_beat_the_alone_time(self) -> None:
        topo = Topology.preset("h100-1nic", 64)
        rng = random.Random(7)
        sends = [
            (rng.uniform(0, 20), rng.randrange(64), rng.randrange(64), rng.uniform(1e8, 1e9))
            for _ in range(3000)
        ]
        began = time.perf_counter()
        ends = finish_times(topo, *sends)
        assert time.perf_counter() - began < 10, "3,000 transfers took too long"
        for (at, src, dst, nbytes), end in zip(sends, ends, strict=True):
            assert end >= at + topo.transfer_time(src, dst, nbytes) * (1 - 1e-9)


class TestFairRates:
    @pytest.mark.parametrize(
        ("paths", "capacity", "rates"),
        [
            ([[0]], {0: 5.0}, [5.0]),
            ([[0], [0]], {0: 6.0}, [3.0, 3.0]),
            ([[0], [0, 1], [1]], {0: 10.0, 1: 4.0}, [8.0, 2.0, 2.0]),
            ([[0, 1], [1], [1]], {0: 1.0, 1: 9.0}, [1.0, 4.0, 4.0]),
            ([[0], [1]], {0: 1.0, 1: 2.0}, [1.0, 2.0]),
        ],
    )
    def test_by_hand(self, paths: list[list[int]], capacity: dict, rates: list[float]) -> None:
        assert fair_rates(paths, capacity) == pytest.approx(rates)

    def test_counts_put_several_flows_on_one_path(self) -> None:
        """Link 1 (3) over 2 flows = 1.5 is the bottleneck; link 0 has 9 - 1.5 left for the 2
        flows of path 0: 3.75 each."""
        rates = fair_rates([[0], [1], [0, 1]], {0: 9.0, 1: 3.0}, counts=[2, 1, 1])
        assert rates == pytest.approx([3.75, 1.5, 1.5])

    def test_random_flows_are_max_min_fair(self) -> None:
        rng = random.Random(1)
        for _ in range(300):
            capacity = {link: rng.choice([1.0, 2.5, 4.0, 10.0]) for link in range(6)}
            paths = [rng.sample(range(6), rng.randint(1, 3)) for _ in range(rng.randint(1, 8))]
            assert_max_min_fair(paths, capacity, fair_rates(paths, capacity))

    def test_paths_sharing_no_link_get_the_fillings_rates_exactly(self) -> None:
        """Such paths take a shortcut (each one's own bottleneck); with a pair that shares a
        link beside them, the progressive filling runs, and must give them the same floats."""
        rng = random.Random(2)
        for _ in range(200):
            links = rng.sample(range(12), 12)
            cuts = sorted(rng.sample(range(1, 12), rng.randint(0, 5)))
            paths = [links[a:b] for a, b in zip([0, *cuts], [*cuts, 12], strict=True)]
            capacity = {link: rng.uniform(0.5, 50.0) for link in range(12)}
            capacity |= {20: rng.uniform(0.5, 50.0), 21: rng.uniform(0.5, 50.0)}
            counts = [rng.randint(1, 4) for _ in paths]
            alone = fair_rates(paths, capacity, counts)
            own = [min(capacity[k] / n for k in p) for p, n in zip(paths, counts, strict=True)]
            assert alone == own
            beside = fair_rates([*paths, [20], [20, 21]], capacity, [*counts, 1, 2])
            assert beside[: len(paths)] == alone


class TestPresets:
    @pytest.mark.parametrize("num_gpus", [1, 8, 9, 64])
    @pytest.mark.parametrize("name", sorted(PRESETS))
    def test_builds_for_any_number_of_gpus(self, name: str, num_gpus: int) -> None:
        topo = Topology.preset(name, num_gpus)
        assert topo.num_gpus == num_gpus
        hosts = {n for n in topo.graph if isinstance(n, str) and n.startswith("host")}
        per_host = num_gpus if name == "single-host" else 8
        assert len(hosts) == -(-num_gpus // per_host)
        gpu_link = PRESETS[name].hosts.gpu_link
        if num_gpus > 1:
            inside = topo.transfer_time(0, 1, GB)
            assert inside == pytest.approx(
                GB / (gpu_link.bandwidth_gbps * GBPS) + gpu_link.latency_us * 1e-6
            ), "two GPUs of one host talk over the host's link"
        for src, dst in [(0, num_gpus - 1), (num_gpus - 1, 0)]:
            assert topo.transfer_time(src, dst, GB) >= 0

    def test_dgx_h100_figures(self) -> None:
        topo = Topology.preset("dgx-h100", 16)
        assert topo.transfer_time(0, 7, 0) == pytest.approx(2e-6)
        assert topo.transfer_time(0, 1, 450 * GB) == pytest.approx(1.0 + 2e-6), "450 GB/s"
        assert [k.bandwidth for k in topo.path(0, 9)] == [50 * GB, 50 * GB], "NIC to NIC"
        assert topo.transfer_time(0, 9, 50 * GB) == pytest.approx(1.0 + 5e-6)

    def test_rails_give_each_gpu_its_nic_and_one_nic_is_shared(self) -> None:
        """Two GPUs of host 0 sending to host 1 at once: on rails each keeps 50 GB/s; behind
        one NIC per host they share it."""
        sends = [(0.0, 0, 8, 50 * GB), (0.0, 1, 9, 50 * GB)]
        rails = finish_times(Topology.preset("dgx-h100", 16), *sends)
        one_nic = finish_times(Topology.preset("h100-1nic", 16), *sends)
        assert rails == pytest.approx([1.0 + 5e-6] * 2)
        assert one_nic == pytest.approx([2.0 + 2e-6 + 5e-6] * 2)

    def test_pcie_ethernet_is_bound_by_100_gbe(self) -> None:
        topo = Topology.preset("pcie-ethernet", 16)
        assert topo.transfer_time(0, 1, 25 * GB) == pytest.approx(1.0 + 2e-6), "PCIe 25 GB/s"
        assert topo.transfer_time(0, 8, 12.5 * GB) == pytest.approx(1.0 + 2e-6 + 20e-6)

    def test_unknown_preset_and_no_gpus_are_refused(self) -> None:
        with pytest.raises(ValueError, match="unknown topology 'dgx'; choose one of: dgx-h100"):
            Topology.preset("dgx", 8)
        with pytest.raises(ValueError, match="num_gpus must be > 0"):
            Topology.preset("dgx-h100", 0)


class TestYaml:
    def test_load_builds_the_hosts_and_the_network(self, tmp_path: Path) -> None:
        (tmp_path / "net.yaml").write_text(
            "hosts: {count: 4, gpus: 8, gpu_link: {bandwidth_gbps: 3600, latency_us: 1}}\n"
            "network: {bandwidth_gbps: 400, latency_us: 5, per: host}\n"
        )
        topo = Topology.load(tmp_path / "net.yaml")
        assert topo.num_gpus == 32
        assert topo.transfer_time(0, 31, 50 * GB) == pytest.approx(1.0 + 1e-6 + 5e-6)
        assert Topology.load(tmp_path / "net.yaml", num_gpus=12).num_gpus == 12

    def test_one_host_needs_no_network(self) -> None:
        topo = Topology.from_dict({"hosts": {"gpus": 2, "gpu_link": {"bandwidth_gbps": 8}}})
        assert topo.transfer_time(0, 1, GB) == pytest.approx(1.0)

    @pytest.mark.parametrize(
        ("raw", "error"),
        [
            ({"hosts": {"gpus": 0, "gpu_link": {"bandwidth_gbps": 1}}}, "hosts.gpus: Input should"),
            ({"hosts": {"gpus": 2}}, "hosts.gpu_link: Field required"),
            (
                {"hosts": {"gpus": 2, "gpu_link": {"bandwidth_gbps": -1}}},
                "hosts.gpu_link.bandwidth_gbps: Input should be greater than 0",
            ),
            (
                {"hosts": {"count": 2, "gpus": 2, "gpu_link": {"bandwidth_gbps": 1}}},
                "network: needed to join 2 hosts",
            ),
            (
                {
                    "hosts": {"count": 2, "gpus": 2, "gpu_link": {"bandwidth_gbps": 1}},
                    "network": {"bandwidth_gbps": 1, "per": "rack"},
                },
                "network.per: Input should be 'host' or 'gpu'",
            ),
            (
                {"hosts": {"gpus": 2, "gpu_link": {"bandwidth_gbps": 1}}, "nics": 2},
                "nics: Extra inputs are not permitted",
            ),
        ],
    )
    def test_errors_name_the_field(self, raw: dict, error: str) -> None:
        with pytest.raises(ValueError, match=f"^topology: {error}"):
            Topology.from_dict(raw)

    def test_errors_name_the_file(self, tmp_path: Path) -> None:
        path = tmp_path / "bad.yaml"
        path.write_text("hosts: {count: 2, gpus: 8, gpu_link: {bandwidth_gbps: 1}}\n")
        with pytest.raises(ValueError, match=f"^{path}: network: needed"):
            Topology.load(path)
        with pytest.raises(ValueError, match="20 GPUs asked for; hosts.count x hosts.gpus = 8"):
            Topology.from_dict({"hosts": {"gpus": 8, "gpu_link": {"bandwidth_gbps": 1}}}, 20)
        with pytest.raises(ValueError, match="cannot read the topology"):
            Topology.load(tmp_path / "missing.yaml")


class TestKvBytes:
    def test_a_6k_token_llama_3_8b_prompt(self) -> None:
        """32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes = 131,072 B/token; 6,144
        tokens = 0.805 GB; at 50 GB/s, 16 ms."""
        per_token = MODELS["llama-3-8b"].kv_bytes_per_token
        assert per_token == 32 * 8 * 128 * 2 * 2 == 131_072
        nbytes = kv_bytes(6144, per_token)
        assert nbytes == 805_306_368
        assert nbytes / (50 * GB) == pytest.approx(0.0161, abs=1e-4)
        cross_host = Topology.preset("dgx-h100", 16).transfer_time(0, 8, nbytes)
        assert cross_host == pytest.approx(0.016106 + 5e-6, abs=1e-6)

    def test_negative_tokens_are_refused(self) -> None:
        with pytest.raises(ValueError, match="num_tokens must be >= 0"):
            kv_bytes(-1, 131_072)
