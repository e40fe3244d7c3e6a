"""mlx-lm's trim interface over an exact `rewind_to`, for caches that can go back only so far."""

from __future__ import annotations


class Rewindable:
    """Mixin: `trim(n)` takes back n tokens when the cache can (see `can_rewind_to`), else
    trims nothing and returns 0, as mlx-lm's caches report a trim they cannot do."""

    offset: int

    def can_rewind_to(self, length: int) -> bool:
        raise NotImplementedError

    def rewind_to(self, length: int) -> None:
        raise NotImplementedError

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        if not self.can_rewind_to(self.offset - n):
            return 0
        self.rewind_to(self.offset - n)
        return n
