"""Benchmarks and load tools for the live proxy (`fairway bench-proxy`, `bench-replicas`,
`bench-soak`, `replay`). Product code never imports them."""
