"""The adaptive policy's shared parts: a decaying tally, a back-off schedule, a decision.

The policy (adaptive.py) keeps acceptance per draft position and tree speeds in Tallies, the
observed check (observed.py) round times; both back off from a losing choice by one Backoff.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tree import TreeShape


@dataclass
class Tally:
    """Decaying totals of a ratio's two sides (seconds and tokens of rounds, accepted and
    drafted ids of a draft position): each add counts fully, every earlier one `decay` times
    less (a window of about 1 / (1 - decay) adds)."""

    decay: float
    total: float = 0.0  # seconds; accepted drafts
    count: float = 0.0  # tokens; drafts tried
    rounds: float = 0.0  # adds, decayed alike
    runs: int = 0  # adds ever (not decayed)

    def add(self, total: float, count: float) -> None:
        self.total = self.decay * self.total + total
        self.count = self.decay * self.count + count
        self.rounds = self.decay * self.rounds + 1.0
        self.runs += 1

    def fade(self, adds: int) -> None:
        """As if `adds` adds of nothing had come since (rounds that went elsewhere)."""
        self.scale(self.decay**adds)

    def scale(self, f: float) -> None:
        self.total, self.count, self.rounds = f * self.total, f * self.count, f * self.rounds

    @property
    def mean(self) -> float:
        """total / count (seconds per token; acceptance); infinite before any count."""
        return self.total / self.count if self.count > 0 else float("inf")


@dataclass
class Backoff:
    """How a losing choice is given up and tried again. A loss: that round and `wait` - 1 more
    go elsewhere (a plain step, a cheaper K), then one round probes the choice again; the next
    loss waits twice as long, up to `cap` rounds; a win resets the wait to `first`. A probe
    costs at most one losing round, so a capped wait wastes little and still notices a draft
    that starts helping again (a passage it knows, code that repeats itself)."""

    first: int
    cap: int
    wait: int = 0  # rounds the next loss gives up (first, till a loss)
    left: int = 0  # rounds still given up before the probe
    waited: int = 0  # rounds given up since the last probe
    due: bool = False  # the probe is due: the next round runs the choice

    def __post_init__(self) -> None:
        self.wait = self.wait or self.first

    @property
    def resting(self) -> bool:
        """Whether the choice is being given up (its probe not yet due)."""
        return self.left > 0

    def lose(self) -> None:
        """The choice lost this round: give up this one and `wait` - 1 more."""
        self.left, self.waited = self.wait - 1, 1
        self.wait = min(2 * self.wait, self.cap)

    def skip(self) -> None:
        """One more round given up; the last one makes the probe due."""
        if self.left > 0:
            self.left -= 1
            self.waited += 1
            self.due = self.left == 0

    def probe(self) -> bool:
        """Whether the probe is due; if so it runs now (`waited`: the rounds given up before
        it, till the next loss)."""
        if not self.due:
            return False
        self.due = False
        return True

    def win(self) -> None:
        self.wait = self.first


@dataclass(frozen=True)
class Decision:
    """One round's choice and why: `reason` names the kind of decision (the same for like
    rounds, so they can be counted), `detail` the figures behind this one."""

    k: int | TreeShape
    reason: str
    detail: str = ""

    @property
    def plain(self) -> bool:
        return self.k == 0

    def __str__(self) -> str:
        if isinstance(self.k, TreeShape):
            head = f"tree {self.k.max_nodes} nodes"
        else:
            head = f"K={self.k}" if self.k else "plain"
        return f"{head}: {self.reason}" + (f" ({self.detail})" if self.detail else "")
