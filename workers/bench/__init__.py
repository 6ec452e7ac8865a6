"""Benchmarks and checks that start workers or simulators beside the proxy: `fairway validate`,
`bench-sim2real`, `bench-proxy` (proxy.py, then scale.py) and `bench-replicas`. Product code
never imports them."""
