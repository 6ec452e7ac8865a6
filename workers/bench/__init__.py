"""Checks of the real-worker path: `fairway validate` and `bench-sim2real`. Product code never
imports them."""
