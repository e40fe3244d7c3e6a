"""Prompt lookup: proposals copied from earlier in the context, graded by their match length."""

from __future__ import annotations

import mlx.core as mx

from .base import Distribution, Drafter, Proposal

# Labels of copied proposals: the length of the context's match, in these buckets (a bucket
# is named by its shortest length). Longer matches are followed far more often, so each bucket
# keeps its own acceptance estimate, starting from COPY_PRIORS: how often the target's next id
# was the copied one (SmolLM2-135M-Instruct, greedy, 128 tokens for 52 of distill's training
# prompts, 3,373 matches; the benchmark prompts gave .16 / .45 / .60 / .69 / .86 / .96 / .97).
MATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 16)
COPY_PRIORS = {1: 0.18, 2: 0.45, 3: 0.53, 4: 0.8, 6: 0.83, 8: 0.87, 16: 0.93}


def match_label(length: int) -> int:
    """The bucket of a match length (0 = no match)."""
    return max((b for b in MATCH_BUCKETS if b <= length), default=0)


class NgramDrafter(Drafter):
    """Prompt lookup: find the most recent earlier occurrence of the last n ids (longest n
    first) in the context and propose what followed it. Proposals are point masses (q = None).

    An index maps each n-gram to the position after its latest occurrence; an n-gram is indexed
    only once the id after it exists, so the current suffix never matches itself. The match is
    then measured backwards beyond n (up to `max_match` ids): its length grades the proposal."""

    name = "ngram"
    summary = "copy from the prompt and output, no draft model"
    needs_hidden = False

    def __init__(
        self,
        max_n: int = 4,
        min_n: int = 1,
        max_match: int = 32,
        stop_ids: frozenset[int] = frozenset(),
    ):
        self.max_n, self.min_n, self.max_match = max_n, min_n, max_match
        # Copies end before these ids (the chat template's turn markers, EOS): an answer that
        # restates the question matches it, but the question's end-of-turn never follows.
        self.stop_ids = stop_ids
        self.history: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}

    def start(self, prompt: list[int], hidden: mx.array | None = None, max_step: int = 1) -> None:
        self.history, self.index = [], {}
        self._extend(prompt)

    state_kind = None  # the index is rebuilt from the ids: cheap next to any model's prefill

    def resume(self, state, prompt, n, hidden=None, max_step=1) -> None:
        self.start(prompt)

    def _extend(self, ids: list[int]) -> None:
        h = self.history
        for t in ids:
            i = len(h)  # position of t: every n-gram ending just before it now has a successor
            for n in range(self.min_n, self.max_n + 1):
                if i >= n:
                    self.index[tuple(h[i - n : i])] = i
            h.append(t)

    def lookup(self, k: int) -> tuple[list[int], int]:
        """(continuation of up to k ids, length of the match); ([], 0) if none."""
        h = self.history
        for n in range(min(self.max_n, len(h)), self.min_n - 1, -1):
            at = self.index.get(tuple(h[len(h) - n :]))
            if at is not None:
                # Copy with overlap (as LZ77): past the end of the history, keep copying the
                # proposal itself, so a repeating cycle is proposed for the full k.
                out: list[int] = []
                for j in range(at, at + k):
                    t = h[j] if j < len(h) else out[j - len(h)]
                    if t in self.stop_ids:
                        break
                    out.append(t)
                if not out:
                    return [], 0
                length = n
                while length < min(self.max_match, at) and h[at - 1 - length] == h[-1 - length]:
                    length += 1
                return out, length
        return [], 0

    def label(self) -> int:
        return match_label(self.lookup(1)[1])

    def propose(self, k: int, dist: Distribution, key: mx.array) -> Proposal:
        tokens, _ = self.lookup(k)
        return Proposal(mx.array(tokens, dtype=mx.int32), None)

    def commit(
        self, k: int, accepted: int, emitted: list[int], hidden: mx.array | None = None
    ) -> None:
        self._extend(emitted)

    def abort(self, k: int) -> None:
        pass
