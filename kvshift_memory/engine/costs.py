"""The cost model: is a stored fragment cheaper to fetch and shift, or to recompute with the question?

A recalled memory whose fragment is in a store's tier (not yet in this process) can be fetched,
checked, decoded and shifted into place, or simply recomputed in the pass that runs the question
anyway. Recomputing costs that pass's marginal time per token, times the memory's tokens; fetching
costs a tier read and a decode, nearly independent of a short memory's length. Very short memories
are therefore cheaper to recompute (and recomputing is exact for them).

Both costs are learned from the engine's own calls on this machine: every forward pass reports its
query tokens and seconds, every fetch its tokens and seconds. A pass's marginal cost per token is
the least-squares slope over recent passes of different sizes; a fetch's cost is a least-squares
line over recent fetches. Until both are known, fragments are fetched.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

__all__ = ["CostModel"]


class CostModel:
    """Seconds a forward pass costs per token, and a fragment fetch per fragment, from observations.

    :param window: how many recent observations of each kind are kept.
    """

    def __init__(self, window: int = 64) -> None:
        self._passes: deque[tuple[int, float]] = deque(maxlen=window)
        self._fetches: deque[tuple[int, float]] = deque(maxlen=window)
        self._lock = threading.Lock()

    def observe_pass(self, tokens: int, seconds: float) -> None:
        """A forward pass over ``tokens`` query tokens took ``seconds``."""
        with self._lock:
            self._passes.append((tokens, seconds))

    def observe_fetch(self, tokens: int, seconds: float) -> None:
        """Fetching, checking and decoding a stored fragment of ``tokens`` tokens took ``seconds``."""
        with self._lock:
            self._fetches.append((tokens, seconds))

    def clear(self) -> None:
        """Forget every observation: until new ones come, fragments and chunks are fetched."""
        with self._lock:
            self._passes.clear()
            self._fetches.clear()

    def pass_token_s(self) -> float | None:
        """Marginal seconds per query token of a forward pass (``None`` until passes of two sizes were seen)."""
        with self._lock:
            line = _line(self._passes)
        return None if line is None else max(line[1], 0.0)

    def fetch_s(self, tokens: int) -> float | None:
        """Expected seconds to fetch a stored fragment of ``tokens`` tokens (``None`` until fetches were seen)."""
        with self._lock:
            if not self._fetches:
                return None
            line = _line(self._fetches)
            if line is None:  # fetches of one size only: their mean
                return sum(s for _, s in self._fetches) / len(self._fetches)
        return max(line[0] + line[1] * tokens, 0.0)

    def recompute_cheaper(self, tokens: int) -> bool:
        """Whether recomputing a stored fragment of ``tokens`` tokens costs less than fetching it."""
        per_token, fetch = self.pass_token_s(), self.fetch_s(tokens)
        return per_token is not None and fetch is not None and tokens * per_token < fetch


def _line(points: Iterable[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares (intercept, slope) of seconds against tokens; ``None`` without two distinct sizes."""
    points = list(points)
    n = len(points)
    if n < 2:
        return None
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread == 0:
        return None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return mean_y - slope * mean_x, slope
