"""A stand-in inner policy for observed.Observed (core/observed.py), whose own choices the tests
inject round times into; an adaptive policy with a long history; a plain softmax distribution
for drafters tested alone."""

import mlx.core as mx

from macspec.core.adaptive import AdaptiveK
from macspec.core.policy import Costs, Policy
from macspec.core.sampling import Distribution, SamplingOptions
from macspec.core.tally import Tally


def policy_at(alpha: float, costs: Costs) -> AdaptiveK:
    """A policy that has seen a long history at acceptance alpha on position 1 (and, with no
    data, the later positions borrow it)."""
    policy = AdaptiveK(k_max=8, costs=costs)
    policy.arm(None).positions = [Tally(0.9, alpha * 1e9, 1e9)]
    return policy


class Softmax(Distribution):
    """The logits' softmax at temperature 1, no sampling options (a drafter's raw q)."""

    def probs(self, logits, extra, first_row, columns=None):
        return mx.softmax(logits, axis=-1)


SOFTMAX = Softmax(SamplingOptions(temperature=1.0), [])


class Proposes(Policy):
    """An inner policy that always proposes `k` (settable: the cost-priced choice stands in) and
    picks the first label offered."""

    def __init__(self, k: int):
        self.k, self.max_k = k, k

    def next_k(self, label=None, launched=False, position=0):
        return self.k

    def pick(self, labels, launched=False, position=0):
        return labels[0]

    def observe(self, k, accepted):
        pass

    def observe_time(self, k, tokens, seconds):
        pass

    def expects_plain(self):
        return False
