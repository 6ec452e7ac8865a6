"""The live side: Fairway's OpenAI proxy in front of real servers.

`live` drives the router core (`router.core.Router`) with asyncio futures, as the simulator
drives it with SimPy events; `app` is the aiohttp proxy around it, `serve` starts workers and
proxies from a cluster.yaml, `replicas` and `shared_state` run several proxies on one port.
The rest are the proxy's parts (request parsing, SSE, errors, metrics, capture, KV-event
monitor) and the clients that drive a live endpoint (`replay`, `load`, the `bench_*` runs).
The core modules in `router/` never import from here (only the CLI does): policies and the
simulator see the core alone.
"""
