"""The live side: Fairway's OpenAI proxy in front of real servers.

`live` drives the router core (`router.core.Router`) with asyncio futures, as the simulator
drives it with SimPy events; `app` holds the HTTP handlers and `forward` one request's trip
(route, queue, send, relay, retry before the first byte). The rest are the proxy's parts:
settings, request parsing, prompts, SSE, errors, metrics, the trace capture and the monitor
that watches the workers. `service/` runs a whole fleet from cluster.yaml (config, the proxy's
lifecycle, replicas and the store they share); `bench/` holds the load tools and benchmarks.
Nothing here imports the simulator or the workers: `fairway serve` starts the workers and hands
the proxy their URLs.
"""
