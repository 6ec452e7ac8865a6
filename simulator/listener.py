"""The defaults of an engine's listener (`simulator.engine.EngineListener`, the contract).

A module of its own, never compiled: router/runtime/native.py compiles the engine, and a
class compiled there takes no interpreted subclass whose methods it runs (mypyc checks `self`
against the class itself), while listeners (test listeners, the emulated worker) extend this.
"""

from __future__ import annotations

from simulator.engine import Engine, Seq


class ListenerDefaults:
    """`EngineListener`'s defaults, for what a listener may leave out: it hears every step's
    tokens, none in sum, and nothing of the engine's changes. A subclass writes its own
    `on_first_token`, `on_tokens` and `on_finish`."""

    counts_tokens = True
    defers_tokens = False

    def on_engine_changed(self, engine: Engine) -> None:
        pass

    def on_progress(
        self, engine: Engine, num_tokens: int, kv_used_blocks: int, next_step_end: float
    ) -> None:
        raise NotImplementedError("a listener that defers tokens takes them in on_progress")

    def on_tokens_settled(self, seqs: list[Seq], num_tokens: int, now: float) -> None:
        raise NotImplementedError("a listener that defers tokens takes them in on_tokens_settled")
