"""The simulator's benchmarks, paper experiments and the demo. Product code never imports them."""
