"""The cluster network as a graph: the links a KV-cache transfer (prefill GPU -> decode GPU)
crosses, and what it takes alone (simulator/transfers.py shares them among transfers).

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

import math
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.config_errors import validated

if TYPE_CHECKING:  # imported where a graph is built: a third of a second, for split fleets only
    import networkx as nx

GBPS = 1e9 / 8  # bytes/s in 1 Gb/s
HOP = 1e-12  # seconds added per hop when choosing a path: equal latencies go the fewest hops


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
        # Each pair's links, as found once: a split fleet asks for them on every request.
        self._links: dict[tuple[int, int], tuple[Link, ...]] = {}

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
        links = self._links.get((src, dst))
        if links is None:
            links = self._links[(src, dst)] = self._find(src, dst)
        return links

    def _find(self, src: int, dst: int) -> tuple[Link, ...]:
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
