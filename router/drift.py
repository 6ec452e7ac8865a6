"""Predicted against actual prefix-cache hits, and the fallback when they drift apart.

The index predicts what the chosen worker holds; vLLM reports what it reused
(`usage.prompt_tokens_details.cached_tokens`). When they disagree for long, the index is wrong
about the workers (a tokenizer or chat-template mismatch, lost KV events, a worker restarted with
an empty cache), and routing by it is worse than routing by load. So each index the router keeps
is scored on every answered request, and routing uses the best one still believable:

    precise (KV events) ─▶ approximate (what was routed) ─▶ load only (no index)

Drift over the last `window` answers is sum |predicted - actual| / sum max(predicted, actual):
0 when they agree to the token, 1 when one says nothing of what the other says. A level is
dropped when its drift passes `threshold` and taken back once it falls under `recover`. Every
level keeps being scored while unused (its predictions cost a match), so recovery is seen.
A window in which neither side saw a hit is no evidence either way: it takes nothing back.
"""

from __future__ import annotations

from collections import deque

LEVELS = ("precise", "approximate", "load")


class DriftScore:
    """Windowed drift of one index's predictions."""

    def __init__(self, window: int) -> None:
        self._pairs: deque[tuple[int, int]] = deque(maxlen=window)
        self._diff = 0
        self._scale = 0

    def add(self, predicted: int, actual: int) -> None:
        if len(self._pairs) == self._pairs.maxlen:
            old_p, old_a = self._pairs[0]
            self._diff -= abs(old_p - old_a)
            self._scale -= max(old_p, old_a)
        self._pairs.append((predicted, actual))
        self._diff += abs(predicted - actual)
        self._scale += max(predicted, actual)

    @property
    def is_full(self) -> bool:
        return len(self._pairs) == self._pairs.maxlen

    @property
    def has_hits(self) -> bool:
        """Some answer in the window was predicted or found to hit: the drift means something."""
        return self._scale > 0

    @property
    def drift(self) -> float:
        return self._diff / self._scale if self._scale else 0.0


class DriftGuard:
    def __init__(
        self,
        levels: tuple[str, ...] = LEVELS,
        window: int = 100,
        threshold: float = 0.5,
        recover: float = 0.25,
    ) -> None:
        if not 0 <= recover <= threshold <= 1:
            raise ValueError("drift: need 0 <= recover <= threshold <= 1")
        if levels[-1] != "load":
            raise ValueError("drift: the last level must be 'load'")
        self.levels, self.threshold, self.recover = levels, threshold, recover
        self.scores = {level: DriftScore(window) for level in levels[:-1]}
        self.level = levels[0]
        self._dropped: set[str] = set()

    def observe(self, predicted: dict[str, int], actual: int) -> str | None:
        """One answered request: each index's predicted hit tokens and the worker's actual.
        Returns the new level when it changes."""
        for level, score in self.scores.items():
            if level in predicted:
                score.add(predicted[level], actual)
        for level, score in self.scores.items():
            if level not in self._dropped and score.is_full and score.drift > self.threshold:
                self._dropped.add(level)
            # Only hits are evidence: over cold prompts an index that can never match (hashed
            # in another block size, say) looks as good as a right one, and was taken back.
            elif (
                level in self._dropped
                and score.is_full
                and score.has_hits
                and score.drift < self.recover
            ):
                self._dropped.discard(level)
        best = next(lvl for lvl in self.levels if lvl == "load" or lvl not in self._dropped)
        if best != self.level:
            self.level = best
            return best
        return None
