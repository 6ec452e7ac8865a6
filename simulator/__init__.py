"""The discrete-event simulator: vLLM-like engines behind the router core, fed by a trace."""

from router.runtime.native import prefer_native

prefer_native(__path__, __name__)
