"""The hybrid drafter's short n-gram matches: the policy picks a copy or the draft model by what
each has paid so far (policy.AdaptiveK.pick, observed.Observed.pick), and the output stays the
target's whatever it picks."""

from collections import Counter

import mlx.core as mx
import pytest
from support.exactness import (
    DEPTH,
    PROMPT,
    N,
    chi_square,
    exact_joint,
    resample_from_p,
    sample_prefixes,
)
from support.policies import Proposes
from support.tinymodels import make_tiny_model

import macspec
import macspec.api.stream as api
import macspec.core.verify as verify
from macspec.core import FixedK, Observations, Observed
from macspec.core.adaptive import AdaptiveK, adaptive
from macspec.core.drafters import COPY_PRIORS, HybridDrafter, NgramDrafter
from macspec.core.drafters.base import Drafter, Proposal
from macspec.core.policy import Costs
from macspec.core.tally import Tally

# Fixed costs (seconds): reproducible choices. A draft token costs a twentieth of a step.
COSTS = Costs(plain_step=1.0, draft_step=0.05, extra=0.05)


def _at(policy: AdaptiveK, label, alpha: float) -> AdaptiveK:
    """`policy` after a long history of `label`'s proposals accepted at rate alpha."""
    policy.arm(label).positions = [Tally(0.9, alpha * 1e9, 1e9)]
    return policy


def _policy() -> AdaptiveK:
    return AdaptiveK(k_max=4, costs=COSTS, copy_max=16, priors=COPY_PRIORS)


# ---------------------------------------------------------------- the choice, priced


def test_a_short_copy_is_picked_where_the_model_loses_and_the_model_where_it_pays():
    missing = _at(_policy(), None, 0.05)  # the model's best round is priced below plain
    assert missing.pick((None, 2)) == 2  # a 2-id match's copy (45% before any) pays
    assert missing.pick((None, 1)) == 1  # (18%): free drafts beat a plain step
    hitting = _at(_policy(), None, 0.9)
    assert hitting.pick((None, 2)) is None and hitting.pick((None, 1)) is None
    # While the model pays it drafts, though a copy is priced faster: only the label that
    # drafts is observed, and a model that missed its first rounds must be seen to recover.
    middling = _at(_policy(), None, 0.35)
    assert middling.expected_speed(2, 2) > middling.expected_speed(middling.best_k(), None)
    assert middling.pick((None, 2)) is None
    # The copies' own record counts: copies seen to miss lose too, and the default stands.
    assert _at(missing, 2, 0.0).pick((None, 2)) is None


def test_a_model_passed_over_while_falling_back_counts_the_round_in_its_wait():
    policy = _at(_policy(), None, 0.05)
    policy.backoff(None).left = 2
    assert [policy.pick((None, 2)) for _ in range(2)] == [2, 2]
    # Its plain stretch is over: its probe is due, and the model drafts it.
    assert policy.backoff(None).due and policy.pick((None, 2)) is None
    assert policy.next_k(None) >= 1


def test_a_launched_pass_asks_the_copy_to_pay_for_its_own_pass():
    policy = _at(_policy(), None, 0.05)
    assert policy.pick((None, 2), launched=True) is None  # 45%: not worth its own pass
    assert _at(policy, 2, 0.95).pick((None, 2), launched=True) == 2


def test_a_label_whose_rounds_lose_here_gives_way_to_the_other_until_its_probe():
    policy = Observed(Proposes(2))
    policy.observe_time(0, 1, 1.0)  # a plain step: 1 s a token
    for _ in range(Observed.FIRST_LOOK):  # the model's rounds: 3 s for one token
        assert policy.next_k(policy.pick((None, 2))) == 2
        policy.observe_time(2, 1, 3.0)
    assert policy.next_k(None) == 0  # vetoed: it rests
    # While the model rests a short match is copied, each such round counted in its wait...
    picks = [policy.pick((None, 2)) for _ in range(Observed.FIRST_WAIT - 1)]
    assert picks == [2] * (Observed.FIRST_WAIT - 1)
    # ...then its probe is due: offered again (the inner policy's first choice).
    assert policy.pick((None, 2)) is None and policy.next_k(None) == 2


def test_without_an_inner_pick_the_default_label_runs():
    policy = Observed(FixedK(3))
    assert policy.pick((None, 1)) is None


# ---------------------------------------------------------------- the hybrid drafter


class Fixed(Drafter):
    """A model drafter stand-in that always proposes id 9."""

    name, summary, needs_hidden = "model", "id 9", False

    def start(self, prompt, hidden=None, max_step=1):
        pass

    def propose(self, k, dist, key):
        return Proposal(mx.array([9] * k, dtype=mx.int32), None)

    def commit(self, k, accepted, emitted, hidden=None):
        pass


def test_the_hybrid_offers_both_for_a_short_match_and_drafts_the_choice():
    hybrid = HybridDrafter(Fixed(), NgramDrafter())
    hybrid.start([1, 2, 3, 1, 2])  # "1 2" matched: a short match, then 3
    assert hybrid.labels() == (None, 2) and hybrid.label() is None
    hybrid.choose(2)
    assert hybrid.label() == 2
    assert hybrid.propose(2, None, None).tokens.tolist() == [3, 1] and hybrid.used.name == "ngram"
    hybrid.commit(2, 0, [7])  # a new context: the choice is spent
    assert hybrid.labels() == (None,) and hybrid.label() is None
    assert hybrid.propose(2, None, None).tokens.tolist() == [9, 9] and hybrid.used.name == "model"
    with pytest.raises(macspec.OptionError, match="label 2"):
        hybrid.choose(2)  # nothing to copy here
    hybrid.commit(0, 0, [1, 2, 3, 1, 2, 3])  # a long match: only its copy
    assert hybrid.labels() == (3,)


# ---------------------------------------------------------------- through generate()


@pytest.fixture()
def priced(monkeypatch):
    """Every generation's policy: the adaptive one at COSTS, without observed round times
    (which would make the choices depend on this machine's clock)."""
    monkeypatch.setattr(api, "_policy", lambda opts, pair: adaptive(opts.num_draft, COSTS))


@pytest.fixture()
def choices(monkeypatch):
    """(short match?, what drafted) of every hybrid proposal from now on."""
    made: Counter = Counter()
    propose = HybridDrafter.propose

    def spy(self, k, dist, key):
        short = 0 < self.ngram.label() < self.min_match
        proposal = propose(self, k, dist, key)
        made[short, self.used.name] += 1
        return proposal

    monkeypatch.setattr(HybridDrafter, "propose", spy)
    return made


def _greedy(pair, prompt: str) -> None:
    plain = macspec.generate(pair, prompt, max_tokens=120, speculative=False)
    assert macspec.generate(pair, prompt, max_tokens=120, num_draft=4).tokens == plain.tokens


def test_short_copies_draft_where_the_model_misses(tmp_path, priced, choices):
    # The target's greedy output repeats itself; the draft, another random model, never agrees.
    target = make_tiny_model(tmp_path / "t", seed=0, hidden=48, scale=2.0, tie=False)
    draft = make_tiny_model(tmp_path / "d", seed=9, hidden=48, tie=False)
    pair = macspec.load(target, draft)
    pair.eos_token_ids = frozenset()
    _greedy(pair, "Once upon")
    short = choices[True, "ngram"] + choices[True, "model"]
    assert short >= 10 and choices[True, "ngram"] >= 0.75 * short  # (the old rule: none)


def test_the_model_drafts_short_matches_where_it_hits(tmp_path, priced, choices):
    target = make_tiny_model(tmp_path / "t", seed=0, hidden=48, tie=False)
    pair = macspec.load(target, target)  # the draft is the target: every draft is right
    pair.eos_token_ids = frozenset()
    for prompt in ("Adapt", "Hello there"):
        _greedy(pair, prompt)
    assert choices[True, "model"] >= 20 and choices[True, "ngram"] == 0


# ---------------------------------------------------------------- exactness while choosing


class Alternating(FixedK):
    """Fixed K, and for a short match a copy or the model by the match and the rounds so far:
    from the context and past rounds only, and both choices within the first DEPTH tokens."""

    def __init__(self, k: int):
        super().__init__(k)
        self.picks: list = []

    def pick(self, labels, launched=False, position=0):
        self.picks.append(labels[(len(self.picks) + labels[1]) % 2])
        return self.picks[-1]


@pytest.fixture()
def alternating(monkeypatch):
    made: list[Alternating] = []

    def policy(opts, pair):
        made.append(Alternating(opts.num_draft))
        return Observed(made[-1], Observations())

    monkeypatch.setattr(api, "_policy", policy)
    return made


def test_choosing_distribution_matches_target(small_pair, alternating):
    options = {"temperature": 1.0}
    expected = exact_joint(small_pair, PROMPT, DEPTH, **options)
    counts = sample_prefixes(small_pair, PROMPT, DEPTH, N, num_draft=2, **options)
    assert chi_square(expected, counts) > 1e-3
    picks = Counter(p for policy in alternating for p in policy.picks)
    assert picks[None] > N // 10 and sum(picks.values()) - picks[None] > N // 10


def test_choosing_distribution_test_detects_a_broken_rule(small_pair, alternating, monkeypatch):
    monkeypatch.setattr(verify, "accept", resample_from_p)
    expected = exact_joint(small_pair, PROMPT, DEPTH, temperature=1.0)
    counts = sample_prefixes(small_pair, PROMPT, DEPTH, N, num_draft=2, temperature=1.0)
    assert chi_square(expected, counts) < 1e-5
