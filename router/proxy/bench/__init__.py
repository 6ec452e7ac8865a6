"""Benchmarks of the proxy alone (`fairway bench-soak`, and the relay `bench-proxy` measures
against). They import neither the simulator nor the workers: benches that start them live in
workers/bench/. Product code never imports them."""
