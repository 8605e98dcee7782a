"""Stop strings with hold-back: text that could still become a stop string is not released yet,
so a stop string never leaks into streamed text."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed the growing output text; learn what is safe to emit and whether a stop string matched."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(s for s in stop if s)
        self._max_len = max((len(s) for s in self.stop), default=0)

    def find(self, text: str, num_checked: int) -> tuple[int, str] | None:
        """First stop string match in `text` that ends after `num_checked` chars: (start, string)."""
        if not self.stop:
            return None
        search_from = max(0, num_checked - self._max_len + 1)
        best: tuple[int, str] | None = None
        for candidate in self.stop:
            index = text.find(candidate, search_from)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, candidate)
        return best

    def safe_length(self, text: str) -> int:
        """Length of the prefix of `text` that cannot be the start of a stop string."""
        if not self.stop:
            return len(text)
        for hold in range(min(self._max_len - 1, len(text)), 0, -1):
            tail = text[-hold:]
            if any(s.startswith(tail) for s in self.stop):
                return len(text) - hold
        return len(text)
