"""The cluster network as a graph, and KV-cache transfers over it (prefill GPU -> decode GPU).

GPUs are the graph's int nodes 0..N-1, and worker i runs on GPU i. A worker with tensor
parallelism spans several GPUs in practice; this model gives each worker one GPU (its KV moves
as one flow). Every other node is a switch, named by a str. Each link is full duplex: its
bandwidth (bytes/s) is per direction, so A->B and B->A never share it.

    network: {per: host}                       network: {per: gpu}  ("rails")

    gpu0 ---+                                                 +--- gpu0 ===+
    gpu1 ---+-- host0 ===== fabric ===== host1 ...    host0 --+--- gpu1 ===+== fabric == ...
    gpu7 ---+   NVSwitch  one NIC a host            NVSwitch  +--- gpu7 ===+  one NIC a GPU

    ---: NVLink (or PCIe) inside a host     ===: the network between hosts

The fabric between hosts is one non-blocking switch (a full-bisection fat tree): only the links
into and out of hosts or GPUs contend. A transfer takes the path of least latency, so with the
presets' figures two GPUs of one host talk over NVLink (or PCIe), not through their NICs. A
host's `gpu_link.latency_us` is GPU to GPU inside it and the network's is host to host (or NIC
to NIC), so each is split in half over its two hops.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple

import simpy
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.config_errors import validated

if TYPE_CHECKING:  # imported where a graph is built: a third of a second, for split fleets only
    import networkx as nx

GBPS = 1e9 / 8  # bytes/s in 1 Gb/s
HOP = 1e-12  # seconds added per hop when choosing a path: equal latencies go the fewest hops
DONE = 1e-9  # a flow with under this many seconds of bytes left at its rate has finished


class LinkSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    bandwidth_gbps: float = Field(gt=0)  # Gb/s, each direction
    latency_us: float = Field(default=0.0, ge=0)  # one way, end to end


class HostsSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    count: int = Field(default=1, gt=0)
    gpus: int = Field(gt=0)  # per host
    gpu_link: LinkSpec  # each GPU's link to its host's switch (NVLink, PCIe)


class NetworkSpec(LinkSpec):
    per: Literal["host", "gpu"] = "host"  # one NIC per host, or one per GPU (rails)


class TopologySpec(BaseModel):
    """The YAML form: `hosts: {count: 4, gpus: 8, gpu_link: {bandwidth_gbps: 3600,
    latency_us: 2}}` and `network: {bandwidth_gbps: 400, latency_us: 5, per: host}`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hosts: HostsSpec
    network: NetworkSpec | None = None  # None: one host, nothing between hosts

    @model_validator(mode="after")
    def _joined(self) -> TopologySpec:
        if self.network is None and self.hosts.count > 1:
            raise ValueError(f"network: needed to join {self.hosts.count} hosts")
        return self


# Bandwidths are public spec figures, per direction. Latencies are order-of-magnitude one-way
# figures for a small message (NVLink, PCIe peer to peer ~1-2 us; RDMA over InfiniBand through a
# switch tier or two ~2-5 us; TCP over Ethernet ~10-30 us): a KV transfer of megabytes is
# dominated by its bandwidth term.
NVLINK4 = LinkSpec(bandwidth_gbps=3600, latency_us=2)  # H100 SXM datasheet: NVLink 900 GB/s per
# GPU counting both directions = 450 GB/s (3,600 Gb/s) each way, all 8 GPUs through NVSwitches
NDR = {"bandwidth_gbps": 400, "latency_us": 5}  # ConnectX-7, InfiniBand NDR: 400 Gb/s = 50 GB/s
PCIE4 = LinkSpec(bandwidth_gbps=200, latency_us=2)  # PCIe Gen4 x16: 16 GT/s x 16 lanes x 128/130
# = 31.5 GB/s raw each way, ~25 GB/s (200 Gb/s) achieved peer to peer (L40S- or A10-class boxes)
PRESETS: dict[str, TopologySpec] = {
    # DGX H100 user guide: 8 single-port ConnectX-7 at 400 Gb/s for the compute fabric, one per
    # GPU, each GPU's NIC on its own rail
    "dgx-h100": TopologySpec(
        hosts=HostsSpec(gpus=8, gpu_link=NVLINK4), network=NetworkSpec(**NDR, per="gpu")
    ),
    # the same box with one 400 Gb/s NIC for the whole host, as many cloud HGX instances
    "h100-1nic": TopologySpec(
        hosts=HostsSpec(gpus=8, gpu_link=NVLINK4), network=NetworkSpec(**NDR, per="host")
    ),
    # 8 PCIe GPUs per host, one 100 GbE NIC per host (12.5 GB/s)
    "pcie-ethernet": TopologySpec(
        hosts=HostsSpec(gpus=8, gpu_link=PCIE4),
        network=NetworkSpec(bandwidth_gbps=100, latency_us=20, per="host"),
    ),
    # every GPU on one NVLink 4 switch, however many (an NVL72 rack is this shape on NVLink 5,
    # 900 GB/s each way); `gpus` here is nominal: the one host grows to hold them all
    "single-host": TopologySpec(hosts=HostsSpec(gpus=8, gpu_link=NVLINK4)),
}


@dataclass(slots=True, frozen=True)
class Link:
    """One direction of a link: `id` indexes `Topology.links`."""

    id: int
    src: int | str
    dst: int | str
    bandwidth: float  # bytes/s
    latency: float  # s


class Topology:
    """A graph of GPUs (int nodes 0..N-1) and switches (str nodes) whose edges carry
    `bandwidth` (bytes/s, each direction) and `latency` (s). An undirected `nx.Graph` edge is a
    full-duplex link; a `nx.DiGraph` edge is one direction alone."""

    def __init__(self, graph: nx.Graph) -> None:
        import networkx as nx

        self.graph = nx.DiGraph(graph)  # a copy: the caller's graph stays theirs
        gpus = sorted(n for n in self.graph if isinstance(n, int))
        if not gpus or gpus != list(range(len(gpus))):
            raise ValueError(f"GPU nodes must be the ints 0..N-1, got {gpus}")
        self.num_gpus = len(gpus)
        self.links: list[Link] = []
        for u, v, data in self.graph.edges(data=True):
            bandwidth, latency = data.get("bandwidth", 0), data.get("latency", 0.0)
            if not (bandwidth > 0 and latency >= 0):
                raise ValueError(f"link {u}->{v}: bandwidth must be > 0 and latency >= 0")
            data["id"] = len(self.links)
            self.links.append(Link(len(self.links), u, v, float(bandwidth), float(latency)))
        self.bandwidths = [k.bandwidth for k in self.links]  # by link id
        self._paths: dict[int, dict[int | str, list[int | str]]] = {}  # by source GPU

    @classmethod
    def from_spec(cls, spec: TopologySpec, num_gpus: int | None = None) -> Topology:
        """`num_gpus` GPUs (default: all the spec's hosts hold), filling hosts in order."""
        hosts, net = spec.hosts, spec.network
        capacity = hosts.count * hosts.gpus
        num_gpus = capacity if num_gpus is None else num_gpus
        if not 0 < num_gpus <= capacity:
            raise ValueError(f"{num_gpus} GPUs asked for; hosts.count x hosts.gpus = {capacity}")
        import networkx as nx

        g = nx.Graph()
        gpu_bw, gpu_lat = hosts.gpu_link.bandwidth_gbps * GBPS, hosts.gpu_link.latency_us * 1e-6
        for gpu in range(num_gpus):
            host = f"host{gpu // hosts.gpus}"
            g.add_edge(gpu, host, bandwidth=gpu_bw, latency=gpu_lat / 2)
            if net is not None:
                nic = gpu if net.per == "gpu" else host
                bw, lat = net.bandwidth_gbps * GBPS, net.latency_us * 1e-6
                g.add_edge(nic, "fabric", bandwidth=bw, latency=lat / 2)
        return cls(g)

    @classmethod
    def preset(cls, name: str, num_gpus: int) -> Topology:
        """`PRESETS[name]` with as many hosts as `num_gpus` needs (the last may be part full)."""
        if name not in PRESETS:
            raise ValueError(f"unknown topology {name!r}; choose one of: {', '.join(PRESETS)}")
        if num_gpus <= 0:
            raise ValueError(f"num_gpus must be > 0, got {num_gpus}")
        spec = PRESETS[name]
        per_host = spec.hosts.gpus if spec.network is not None else num_gpus
        count = math.ceil(num_gpus / per_host)
        hosts = spec.hosts.model_copy(update={"count": count, "gpus": per_host})
        return cls.from_spec(spec.model_copy(update={"hosts": hosts}), num_gpus)

    @classmethod
    def named(cls, name: str, num_gpus: int) -> Topology:
        """A YAML (or JSON) file, by its suffix; else a preset's name (`preset`)."""
        if Path(name).suffix in (".yaml", ".yml", ".json"):
            return cls.load(name, num_gpus)
        return cls.preset(name, num_gpus)

    @classmethod
    def load(cls, path: str | Path, num_gpus: int | None = None) -> Topology:
        """A topology from YAML (or JSON); errors name the file and the field."""
        try:
            raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"{path}: cannot read the topology: {e}") from None
        return cls.from_dict(raw, num_gpus, source=str(path))

    @classmethod
    def from_dict(
        cls, raw: object, num_gpus: int | None = None, source: str = "topology"
    ) -> Topology:
        spec = validated(TopologySpec, raw, source)
        try:
            return cls.from_spec(spec, num_gpus)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def path(self, src: int, dst: int) -> tuple[Link, ...]:
        """The links a transfer from GPU `src` to GPU `dst` crosses, in order: the path of least
        summed latency (then fewest hops); none from a GPU to itself."""
        for gpu in (src, dst):
            if not (isinstance(gpu, int) and 0 <= gpu < self.num_gpus):
                raise ValueError(f"GPU {gpu!r} is not in this topology (0..{self.num_gpus - 1})")
        if src == dst:
            return ()
        if src not in self._paths:
            import networkx as nx

            self._paths[src] = nx.single_source_dijkstra_path(
                self.graph, src, weight=lambda u, v, d: d["latency"] + HOP
            )
        nodes = self._paths[src].get(dst)
        if nodes is None:
            raise ValueError(f"no path from GPU {src} to GPU {dst}")
        return tuple(self.links[self.graph.edges[u, v]["id"]] for u, v in pairwise(nodes))

    def transfer_time(self, src: int, dst: int, nbytes: float) -> float:
        """Seconds to move `nbytes` from `src` to `dst` alone on the network: the bytes at the
        path's bottleneck bandwidth, plus its summed latency."""
        links = self.path(src, dst)
        if not links:
            return 0.0
        return nbytes / min(k.bandwidth for k in links) + sum(k.latency for k in links)


def kv_bytes(num_tokens: int, kv_bytes_per_token: int) -> int:
    """Bytes of KV cache for `num_tokens` tokens (`ModelSpec.kv_bytes_per_token`: 2 (K, V) x
    layers x KV heads x head dim x bytes per value). What a split request moves is its prompt's
    KV less any prefix the decode worker already holds; the caller decides `num_tokens`."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return num_tokens * kv_bytes_per_token


def fair_rates(
    paths: Sequence[Sequence[int]],
    capacity: Sequence[float] | Mapping[int, float],
    counts: Sequence[int] | None = None,
) -> list[float]:
    """Max-min fair rates of flows crossing `paths` (link ids) over links of `capacity` (by
    link id; `counts[i]` flows on path i, default one each; each gets the rate returned for its
    path), by progressive filling: the link with the least capacity left per unfixed flow fixes
    its flows at that share; their rates leave the other links they cross; repeat until every
    flow is fixed. A link's share only grows as others fix, so a heap with stale entries skipped
    finds the next bottleneck: O(path links x log links)."""
    counts = counts if counts is not None else [1] * len(paths)
    rates = [0.0] * len(paths)
    users: dict[int, list[int]] = {}
    unfixed: dict[int, int] = {}  # link -> flows on it not yet fixed
    for i, links in enumerate(paths):
        assert links and counts[i] > 0, f"path {i} crosses no link or carries no flow"
        for link in links:
            users.setdefault(link, []).append(i)
            unfixed[link] = unfixed.get(link, 0) + counts[i]
    left = {link: float(capacity[link]) for link in users}
    share_of = {link: left[link] / n for link, n in unfixed.items()}  # the live heap entries
    heap = [(share, link) for link, share in share_of.items()]
    heapq.heapify(heap)
    is_fixed = [False] * len(paths)
    while heap:
        share, bottleneck = heapq.heappop(heap)
        if share_of.get(bottleneck) != share:
            continue  # stale: the link's share has grown since, or its flows are fixed
        del share_of[bottleneck]
        touched: set[int] = set()
        for i in users[bottleneck]:
            if is_fixed[i]:
                continue
            is_fixed[i], rates[i] = True, share
            for link in paths[i]:
                left[link] -= share * counts[i]
                unfixed[link] -= counts[i]
            touched.update(paths[i])
        touched.discard(bottleneck)
        for link in touched:
            if unfixed[link]:
                share_of[link] = left[link] / unfixed[link]
                heapq.heappush(heap, (share_of[link], link))
            else:
                share_of.pop(link, None)
    return rates


class Transfer(NamedTuple):
    src: int
    dst: int
    nbytes: float
    start: float
    end: float  # when the last byte arrived: its bytes done, plus the path's latency


@dataclass(slots=True, eq=False)
class _Path:
    """The flows in flight on one path. Flows crossing the same links get the same max-min rate,
    so they advance together: `served` counts the bytes each has moved since the path was
    opened, and a flow is done when it reaches the mark (`served` at its start + its bytes) the
    flow is filed under in `flows`, a heap (first to finish on top).

        served at start        served now          mark
        |---- moved -----------|---- remaining ----|
    """

    links: tuple[int, ...]
    latency: float
    rate: float = 0.0  # bytes/s, each flow
    served: float = 0.0
    flows: list[tuple[float, int, Transfer, Callable[[Transfer], object]]] = field(
        default_factory=list
    )


class KVTransfers:
    """Transfers in flight on a `Topology`, sharing every link max-min fairly.

    A flow occupies its links from `send` until its last byte leaves; the path's latency (the
    tail's propagation) is added once, after that. Rates are recomputed, over the paths in flight
    only, whenever a flow starts or its bytes finish; between those moments every flow's bytes go
    at a constant rate, so one timer (the next finish) is all that is scheduled: exact, no steps.
    A start or finish costs O(paths in flight), however many flows share them.
    """

    def __init__(self, env: simpy.Environment, topology: Topology) -> None:
        self.env = env
        self.topology = topology
        self.records: list[Transfer] = []  # in order of arrival; `end` filled in on arrival
        self.num_active = 0  # flows whose bytes are still moving
        self._paths: dict[tuple[int, ...], _Path] = {}  # in flight, by link ids
        self._updated = env.now  # when `served` was last advanced
        self._timer = 0  # the generation of the one live wake-up; older ones are ignored
        self._seq = 0  # files flows with the same mark in order of sending

    def send(
        self,
        src: int,
        dst: int,
        nbytes: float,
        then: Callable[[Transfer], object] | None = None,
    ) -> simpy.Event | None:
        """Start moving `nbytes` from GPU `src` to GPU `dst`; the event returned fires (with
        its `Transfer`) when the last byte has arrived, or `then(transfer)` is called then
        instead (one SimPy event fewer per transfer, for a simulation's hot path). The same
        GPU: at once."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        links = self.topology.path(src, dst)
        latency = sum(k.latency for k in links)
        transfer = Transfer(src, dst, nbytes, self.env.now, math.nan)
        event = self.env.event() if then is None else None
        arrived = then if then is not None else event.succeed  # type: ignore[union-attr]
        if not links or nbytes == 0:
            self._arrive(transfer, arrived, latency)
            return event
        self._advance()
        ids = tuple(k.id for k in links)
        path = self._paths.get(ids)
        if path is None:
            path = self._paths[ids] = _Path(ids, latency)
        self._seq += 1
        heapq.heappush(path.flows, (path.served + nbytes, self._seq, transfer, arrived))
        self.num_active += 1
        self._reshare()
        return event

    def _advance(self) -> None:
        elapsed, self._updated = self.env.now - self._updated, self.env.now
        for path in self._paths.values():
            path.served += path.rate * elapsed

    def _reshare(self) -> None:
        """New fair rates for the paths in flight, and a wake-up at the next flow's finish."""
        paths = list(self._paths.values())
        capacity = self.topology.bandwidths
        rates = fair_rates([p.links for p in paths], capacity, [len(p.flows) for p in paths])
        for path, rate in zip(paths, rates, strict=True):
            path.rate = rate
        self._timer += 1  # SimPy cannot cancel a timeout: the older one fires and is ignored
        if paths:
            first = min(paths, key=lambda p: (p.flows[0][0] - p.served) / p.rate)
            timer, delay = self._timer, max((first.flows[0][0] - first.served) / first.rate, 0.0)
            self.env.timeout(delay).callbacks.append(lambda _: self._wake(timer, first))

    def _wake(self, timer: int, first: _Path) -> None:
        if timer != self._timer:
            return  # a start or finish since then rescheduled
        self._advance()
        first.served = max(first.served, first.flows[0][0])  # its first flow finishes now
        for ids, path in list(self._paths.items()):
            while path.flows and path.flows[0][0] - path.served <= path.rate * DONE:
                _, _, transfer, arrived = heapq.heappop(path.flows)
                self.num_active -= 1
                self._arrive(transfer, arrived, path.latency)
            if not path.flows:
                del self._paths[ids]
        self._reshare()

    def _arrive(
        self, transfer: Transfer, arrived: Callable[[Transfer], object], latency: float
    ) -> None:
        def land(_: object = None) -> None:
            done = transfer._replace(end=self.env.now)
            self.records.append(done)
            arrived(done)

        if latency > 0:
            self.env.timeout(latency).callbacks.append(land)
        else:
            land()
