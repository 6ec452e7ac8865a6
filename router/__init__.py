"""Fairway's core: requests, the prefix index, the cluster view, the policy contract and the
router (`core.Router`) that the simulator and the live proxy (`router.proxy`) both drive."""

from router.runtime.native import prefer_native

prefer_native(__path__, __name__)
