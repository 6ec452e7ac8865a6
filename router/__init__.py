"""Fairway's core: requests, the prefix index, the cluster view, the policy contract."""
