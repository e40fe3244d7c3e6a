"""Drafters propose tokens for the target to verify.

A drafter returns its proposal and the distribution q each token was drawn from; a deterministic
drafter returns q = None (a point mass), which the acceptance rule handles as a one-hot q.

`Drafter` is the base every drafter derives from: the calls each makes (start, propose,
commit, abort) and the optional abilities with their defaults (several labels to choose
from, catch-up time, token trees, a state the prompt cache keeps), so that callers call
methods instead of asking whether a drafter has them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import mlx.core as mx

from ...base.errors import CacheError, OptionError
from ..sampling import Distribution

if TYPE_CHECKING:  # (tree.py imports the sampling module only; typing alone here)
    from ..caches import DraftState
    from ..tree import Tree, TreeShape

# A drafter's grade of its next proposal, from the context alone (the n-gram match length);
# None = ungraded (a draft model); 0 = nothing to propose.
Label = int | None


@dataclass
class Proposal:
    tokens: mx.array  # (k,) int32 proposed ids
    probs: mx.array | None  # (k, V) distributions they were drawn from; None = point masses


class Drafter:
    """What proposes drafts. Subclasses define start, propose, commit and abort; the rest has
    defaults: one label (`label()`), no catch-up, no trees, no state for the prompt cache."""

    name: ClassVar[str]  # its key in the registry (drafters/__init__.py)
    summary: ClassVar[str]  # what it drafts from, in a few words
    # True when the drafter reads the target's hidden states (then `hidden` below is given).
    needs_hidden: bool = False
    # Decoder layers whose outputs the drafter reads too (joined before the final hidden state
    # in `hidden`); () = the final hidden state only.
    feature_layers: tuple[int, ...] = ()
    # The prompt cache: the kind of state snapshot() gives (None: nothing kept, the state is
    # rebuilt from the ids by resume()); False: it cannot resume, the prompt cache is off.
    state_kind: str | None | bool = False
    # Whether it can start from a prompt's ids alone (a draft model): the prompt cache then
    # restores the target from an entry that kept no state of this drafter's (plain decoding's).
    rebuilds_from_ids: bool = False

    def start(self, prompt: list[int], hidden: mx.array | None = None, max_step: int = 1) -> None:
        """Begin a sequence whose context is `prompt` (the target holds all but its last token).
        `hidden`: the target's hidden states (len(prompt) - 1, H) for the positions it read;
        `max_step`: 1 + the most drafts a proposal will be asked for."""
        raise NotImplementedError

    def label(self) -> Label:
        """A grade of the next proposal from the context alone, for the policy to keep separate
        acceptance statistics: the n-gram match length (0 = nothing to propose), or None for a
        draft model."""
        return None

    def labels(self) -> tuple[Label, ...]:
        """The labels the next proposal may take, its default first (a hybrid's short match:
        its model or a copy); choose() picks one. One by default: label()."""
        return (self.label(),)

    def choose(self, label: Label) -> None:
        """Draft the next proposal as `label` (one of labels()) says."""

    def propose(self, k: int, dist: Distribution, key: mx.array) -> Proposal:
        """Propose up to k next tokens (lazily evaluated arrays are fine)."""
        raise NotImplementedError

    def drafted_by(self) -> str:
        """The registry name of what drafted the last proposal (a hybrid's copy or its model)."""
        return self.name

    def commit(
        self, k: int, accepted: int, emitted: list[int], hidden: mx.array | None = None
    ) -> None:
        """After verification: `accepted` of the k proposed were kept, then `emitted` (the kept
        drafts plus the target's token) extend the context. k == 0 is a plain target step.
        `hidden`: the target's hidden states at the positions it kept this round, i.e. the
        previous last id and the accepted drafts (accepted + 1 rows)."""
        raise NotImplementedError

    def abort(self, k: int) -> None:
        """Undo a proposal of k tokens whose round failed, so the next round starts clean."""
        raise NotImplementedError

    def take_catch_up(self) -> float:
        """Seconds spent reading ids it missed (plain steps, copied rounds) since last asked:
        0 for drafters that never fall behind (n-gram copies, feature drafts)."""
        return 0.0

    # ---------------------------------------------------------------- token trees (tree.py)

    def propose_tree(self, shape: TreeShape) -> Tree:
        """Candidates as a token tree of this shape (a draft model and the EAGLE draft do)."""
        raise OptionError(f"the {self.name} drafter drafts no token trees")

    def commit_tree(
        self, t: Tree, accepted: list[int], emitted: list[int], hidden: mx.array | None = None
    ) -> None:
        """After verification: the accepted nodes, then `emitted` (their ids and the target's
        token) extend the context; `hidden`: the target's hidden states at the kept rows."""
        raise OptionError(f"the {self.name} drafter drafts no token trees")

    # ---------------------------------------------------------------- the prompt cache

    def snapshot(self) -> DraftState | None:
        """Between rounds: its live state, of kind state_kind (the prompt cache copies it)."""
        return None

    def resume(
        self,
        state: DraftState | None,
        prompt: list[int],
        n: int,
        hidden: mx.array | None = None,
        max_step: int = 1,
    ) -> None:
        """start() from a state restored to the first n ids, `hidden` for the rest."""
        raise CacheError(f"the {self.name} drafter cannot resume from a kept state")
