"""Draft-free (n-gram) drafting, adaptive K and the fallback to plain decoding stay exact."""

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
from support.policies import policy_at
from support.tinymodels import make_tiny_model

import macspec
import macspec.core.verify as verify
from macspec.core.adaptive import AdaptiveK, Trees
from macspec.core.adaptive import adaptive as adaptive_policy
from macspec.core.drafters import COPY_PRIORS, NgramDrafter, match_label
from macspec.core.policy import COPY_FACTOR, Costs
from macspec.core.tally import Decision
from macspec.core.tree import TreeShape


@pytest.fixture(scope="module")
def small_ngram(small_pair):
    p = macspec.load(small_pair.target_path, drafter="ngram")
    p.eos_token_ids = frozenset()
    return p


# Fixed costs (seconds) instead of this machine's measurements: reproducible policy decisions.
CHEAP_DRAFT = Costs(plain_step=1.0, draft_step=0.05, extra=0.05)
SLOW_DRAFT = Costs(plain_step=1.0, draft_step=0.3, extra=0.1)


@pytest.fixture()
def costs(monkeypatch):
    """Make every pair loaded from now on measure the given costs; pairs loaded earlier (shared
    fixtures) get them for this test."""

    def use(c: Costs, *loaded: macspec.Pair) -> None:
        monkeypatch.setattr(macspec.api.pair, "calibrate", lambda pair: c)
        for p in loaded:
            monkeypatch.setattr(p, "costs", c)

    return use


# ---------------------------------------------------------------- n-gram lookup


def test_ngram_finds_the_most_recent_longest_match():
    d = NgramDrafter(max_n=3)
    d.start([1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3])
    assert d.lookup(4) == ([8, 5, 2, 3], 2)  # "2 3" last seen before 8; "5 2 3" never
    d.commit(0, 0, [7])
    assert d.lookup(2) == ([], 0)  # 7 never occurred before
    d.commit(0, 0, [1, 2, 3])
    assert d.lookup(3) == ([8, 5, 2], 3)  # "1 2 3" most recently followed by 8


def test_ngram_grades_a_proposal_by_the_whole_match_length():
    d = NgramDrafter()  # 4-grams at most are indexed; the match is measured further back
    d.start([1, 2, 3, 4, 5, 9, 6, 1, 2, 3, 4, 5])
    assert d.lookup(2) == ([9, 6], 5)  # "1 2 3 4 5" matched, not just its last 4 ids
    assert d.label() == 4  # bucket 4-5
    d.start([0] + [7, 8] * 20)  # a cycle: the match runs to max_match
    assert d.lookup(3) == ([7, 8, 7], 32) and d.label() == 16
    d.start([5, 5])  # the earlier occurrence starts the history: nothing further back
    assert d.lookup(1) == ([5], 1)
    assert [match_label(n) for n in (0, 1, 3, 5, 7, 15, 16, 40)] == [0, 1, 3, 4, 6, 8, 16, 16]


def test_ngram_copies_stop_before_control_tokens():
    """An answer restating the question matches it; the question's end-of-turn (here 99) is
    never copied, and a copy that would start with it is no proposal at all."""
    d = NgramDrafter(stop_ids=frozenset({99}))
    d.start([1, 2, 3, 4, 99, 7, 2, 3])
    assert d.lookup(4) == ([4], 2)
    d.commit(0, 0, [4])
    assert d.lookup(4) == ([], 0) and d.label() == 0


def test_ngram_never_matches_the_suffix_with_itself():
    d = NgramDrafter()
    d.start([4, 5, 6])
    assert d.lookup(3) == ([], 0)


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("prompt", ["abab abab ab", "The cat. The cat. The", [5, 6, 7, 5, 6, 7, 5]])
def test_ngram_greedy_equals_target_only(tiny_dirs, prompt):
    ngram = macspec.load(tiny_dirs[0], drafter="ngram")
    plain = macspec.generate(ngram, prompt, max_tokens=60, speculative=False)
    for adaptive in (False, True):
        r = macspec.generate(ngram, prompt, max_tokens=60, num_draft=5, adaptive=adaptive)
        assert r.tokens == plain.tokens
    fixed = macspec.generate(ngram, prompt, max_tokens=60, num_draft=5, adaptive=False)
    assert fixed.stats.drafted > fixed.stats.accepted  # rejections were exercised


@pytest.mark.parametrize("k", [1, 3, 6])
def test_adaptive_and_hybrid_greedy_equal_target_only(tiny_dirs, costs, k):
    costs(CHEAP_DRAFT)
    pair = macspec.load(*tiny_dirs)
    for prompt in ("Adapt", "xyzxyzxyz"):
        plain = macspec.generate(pair, prompt, max_tokens=50, speculative=False)
        r = macspec.generate(pair, prompt, max_tokens=50, num_draft=k)
        assert r.tokens == plain.tokens
        assert r.stats.drafted > r.stats.accepted


@pytest.mark.parametrize("options", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 3}])
def test_ngram_distribution_matches_target(small_ngram, options):
    expected = exact_joint(small_ngram, PROMPT, DEPTH, **options)
    counts = sample_prefixes(small_ngram, PROMPT, DEPTH, N, num_draft=2, adaptive=False, **options)
    assert chi_square(expected, counts) > 1e-3


def test_ngram_distribution_test_detects_a_broken_rule(small_ngram, monkeypatch):
    monkeypatch.setattr(verify, "accept", resample_from_p)
    expected = exact_joint(small_ngram, PROMPT, DEPTH, temperature=1.0)
    # Fixed K, as the test above: every round copies, whatever the policy would choose.
    counts = sample_prefixes(
        small_ngram, PROMPT, DEPTH, N, num_draft=2, adaptive=False, temperature=1.0
    )
    assert chi_square(expected, counts) < 1e-5


def test_adaptive_ngram_distribution_matches_target(small_ngram, costs):
    """Adaptive K per match length (copies up to COPY_FACTOR x num_draft), at temperature 1."""
    costs(CHEAP_DRAFT, small_ngram)
    options = {"temperature": 1.0, "min_p": 0.05}
    expected = exact_joint(small_ngram, PROMPT, DEPTH, **options)
    counts = sample_prefixes(small_ngram, PROMPT, DEPTH, N, num_draft=2, **options)
    assert chi_square(expected, counts) > 1e-3


def test_adaptive_distribution_matches_target(small_pair, costs):
    """Adaptive K with the draft's confidence stop, at temperature 1."""
    costs(CHEAP_DRAFT)
    fresh = macspec.load(small_pair.target_path, small_pair.draft_path)
    fresh.eos_token_ids = frozenset()
    options = {"temperature": 1.0, "top_p": 0.9}
    expected = exact_joint(fresh, PROMPT, DEPTH, **options)
    counts = sample_prefixes(fresh, PROMPT, DEPTH, N, num_draft=3, **options)
    assert chi_square(expected, counts) > 1e-3


# ---------------------------------------------------------------- behaviour


def test_ngram_accepts_long_copied_spans_when_text_repeats(tmp_path):
    # This random model's greedy output falls into cycles ("?W?W?W", "LLLL"): text that repeats.
    target = make_tiny_model(tmp_path / "t", seed=0, hidden=48, scale=2.0, tie=False)
    ngram = macspec.load(target, drafter="ngram")
    ngram.eos_token_ids = frozenset()
    options = {"max_tokens": 150, "num_draft": 8, "adaptive": False}
    r = macspec.generate(ngram, "Once upon", **options)
    assert (
        r.tokens == macspec.generate(ngram, "Once upon", max_tokens=150, speculative=False).tokens
    )
    spans = [len(e.accepted) for e in macspec.stream_generate(ngram, "Once upon", **options)]
    assert spans.count(8) >= 5  # whole K=8 copies accepted
    assert r.stats.mean_accepted_length > 3.0
    assert r.stats.rounds < 150 / 2


def test_useless_draft_falls_back_to_plain_decoding(tmp_path, costs):
    costs(SLOW_DRAFT)
    # A random draft for a different random target: almost nothing is accepted.
    target = make_tiny_model(tmp_path / "t", seed=0, tie=False)
    draft = make_tiny_model(tmp_path / "d", seed=9, tie=False)
    pair = macspec.load(target, draft, drafter="model")
    pair.eos_token_ids = frozenset()
    plain = macspec.generate(pair, "Hello", max_tokens=120, speculative=False)
    r = macspec.generate(pair, "Hello", max_tokens=120, num_draft=4)
    assert r.tokens == plain.tokens
    assert r.stats.speculative_rounds <= 0.25 * r.stats.rounds


def test_policy_switches_to_plain_when_losing_and_back_when_helping():
    policy = AdaptiveK(k_max=4, costs=SLOW_DRAFT, probe_after=4)
    assert policy.next_k() >= 1  # optimistic prior: try speculation
    for _ in range(6):  # nothing accepted
        policy.observe(4, 0)
    assert [policy.next_k() for _ in range(4)] == [0, 0, 0, 0]  # plain decoding...
    assert policy.next_k() >= 1  # ...then one probe round
    policy.observe(1, 0)  # the probe fails: a longer plain stretch (8 steps) follows
    assert [policy.next_k() for _ in range(9)] == [0] * 8 + [1]
    for _ in range(6):  # the draft now helps: everything accepted
        policy.observe(4, 4)
    assert [policy.next_k() for _ in range(5)] == [4] * 5


def test_policy_keeps_separate_statistics_per_label():
    policy = AdaptiveK(k_max=2, costs=SLOW_DRAFT, probe_after=4, copy_max=8)

    def play(label: int, accept: bool) -> int:
        k = policy.next_k(label)
        policy.observe(k, k if accept else 0)
        return k

    for _ in range(8):  # 1-gram copies are always rejected, 4-gram copies always accepted
        play(1, False)
        play(4, True)
    weak = [play(1, False) for _ in range(30)]
    assert sum(k > 0 for k in weak) <= 3  # weak matches: plain steps, rarer and rarer probes
    assert [play(4, True) for _ in range(3)] == [8, 8, 8]  # copy_max, no draft time to pay
    assert 1 <= policy.next_k(None) <= 2  # the draft model's own estimate: still the prior
    assert policy.next_k(0) == 0  # nothing to propose


def test_policy_picks_longer_drafts_for_higher_acceptance():
    low, high = AdaptiveK(k_max=8, costs=CHEAP_DRAFT), AdaptiveK(k_max=8, costs=CHEAP_DRAFT)
    for _ in range(10):
        low.observe(4, 1)
        high.observe(4, 4)
    assert 1 <= low.best_k() < high.best_k() == 8


CONCAVE = ((1, 1.2), (2, 1.37), (4, 1.6), (8, 1.75))  # SmolLM2-135M, OpenBLAS, 2 cores (ratios)


def test_pass_time_interpolates_the_measured_passes():
    c = Costs(plain_step=1.0, draft_step=0.0, extra=0.15, verify=CONCAVE)
    assert c.pass_time(0) == 1.0
    assert c.pass_time(2) == pytest.approx(1.37)
    assert c.pass_time(3) == pytest.approx(1.485)  # halfway between k=2 and k=4
    assert c.pass_time(6) == pytest.approx(1.675)
    assert c.pass_time(10) == pytest.approx(1.825)  # the last slope, 0.0375 per draft, goes on
    assert Costs(plain_step=1.0, draft_step=0.0, extra=0.15).pass_time(3) == pytest.approx(1.45)


def test_policy_prices_k_with_the_measured_passes():
    linear = Costs(plain_step=1.0, draft_step=0.0, extra=0.15)
    measured = Costs(plain_step=1.0, draft_step=0.0, extra=0.15, verify=CONCAVE)
    # Well-accepted drafts: wide passes cost less than the slope says, so K goes further.
    assert policy_at(0.8, linear).best_k() == 5
    assert policy_at(0.8, measured).best_k() == 8
    # Poorly accepted drafts: the slope says K=1 breaks even, the measured pass says it loses.
    assert policy_at(0.16, linear).next_k() == 1
    assert policy_at(0.16, measured).next_k() == 0


def test_a_launched_pass_makes_drafts_pay_for_their_own_pass():
    """After a plain step that launched the next pass (core/loop.py), that pass yields a
    token by itself: speculating adds only the drafts' pass, which must pay at plain speed."""
    costs = Costs(plain_step=1.0, draft_step=0.0, extra=0.15, verify=CONCAVE)
    policy = policy_at(0.5, costs)
    # Half the drafts accepted: a 3-id pass pays against a plain step (1.75 tokens for 1.37),
    # but not the 2 ids it adds beyond a running pass (0.75 tokens for 1.2 steps).
    assert policy.next_k() >= 2
    assert policy.next_k(launched=True) == 0
    assert policy.backoff(None).left == 0  # no evidence against drafting: no back-off
    # 95%: the drafts pay for their own pass (8 of them: 6.4 more tokens for 8 rows, 1.71).
    assert policy_at(0.95, costs).next_k(launched=True) == 8
    assert policy_at(0.95, costs).marginal_speed(1) == pytest.approx(0.95 / 1.0)


def test_policy_starts_each_match_length_from_its_prior():
    costs = Costs(plain_step=1.0, draft_step=0.0, extra=0.15, verify=CONCAVE)
    policy = AdaptiveK(k_max=4, costs=costs, copy_max=8, priors=COPY_PRIORS)
    # Before any round: a 1-id match (followed 18% of the time) is not worth a pass of 2 ids,
    # a match of 16+ ids (93%) is copied as far as allowed; without priors both start at 0.6.
    assert policy.next_k(1) == 0 and policy.next_k(16) == 8
    blind = AdaptiveK(k_max=4, costs=costs, copy_max=8)
    assert blind.next_k(1) >= 1 and blind.next_k(16) == blind.best_k(1)


def test_k_used_per_round_is_reported(pair):
    events = list(macspec.stream_generate(pair, "Report", max_tokens=40, num_draft=5))
    assert all(0 <= e.num_draft <= COPY_FACTOR * 5 for e in events)  # copies may run longer
    assert all(e.num_draft == len(e.accepted) + len(e.rejected) for e in events)


def test_invalid_drafter_options(tiny_dirs):
    with pytest.raises(macspec.OptionError, match="drafter"):
        macspec.load(tiny_dirs[0], drafter="magic")
    with pytest.raises(macspec.OptionError, match="ngram"):
        macspec.load(tiny_dirs[0], tiny_dirs[1], drafter="ngram")


def test_acceptance_is_estimated_per_draft_position():
    policy = AdaptiveK(k_max=4, costs=CHEAP_DRAFT)
    arm = policy.arm(None)
    assert arm.rates(3) == pytest.approx([0.6, 0.6, 0.6])  # the prior, borrowed down the chain
    assert arm.expected_tokens(2) == pytest.approx(1 + 0.6 + 0.36)
    policy.observe(2, 1)  # position 1 accepted, position 2 rejected
    # position 1: (1 + 0.6) / (1 + 1); position 2: (0 + 0.8) / (1 + 1); position 3 borrows 0.4
    assert arm.rates(3) == pytest.approx([0.8, 0.4, 0.4])
    assert arm.expected_tokens(3) == pytest.approx(1 + 0.8 + 0.32 + 0.128)
    policy.observe(1, 0)  # older counts decay by 0.9 before the new round is added
    assert arm.rates(1) == pytest.approx([(0.9 + 0.6) / (1.9 + 1)])


def test_a_weak_second_position_keeps_k_at_one():
    # The default draft on a chat answer: the first draft right half the time, the second
    # (built on the draft's own guess) almost never. One pooled geometric rate (1/3 here) says
    # even K=1 loses (1.33 tokens for 1.35 steps); per position, K=1 wins 1.5 tokens for 1.35.
    policy = AdaptiveK(k_max=4, costs=Costs(1.0, 0.15, 0.1, verify=CONCAVE))
    for i in range(20):
        policy.observe(2, i % 2)
    first, second = policy.arm(None).rates(2)
    assert 0.45 < first < 0.6 and second < 0.1
    assert [policy.next_k() for _ in range(5)] == [1] * 5


def test_a_short_run_of_misses_does_not_stop_a_draft_that_pays():
    # Break-even here is a first-position acceptance of ~0.28 at K=1; the draft runs at 0.5.
    policy = AdaptiveK(k_max=4, costs=Costs(1.0, 0.075, 0.1, verify=CONCAVE))
    for i in range(30):
        policy.observe(policy.next_k(), i % 2)
    for _ in range(3):  # three misses in a row: 1 chance in 8 at this rate
        policy.observe(policy.next_k(), 0)
    assert policy.next_k() == 1


def test_plain_stretches_double_up_to_32_steps_between_probes():
    policy = AdaptiveK(k_max=4, costs=SLOW_DRAFT, probe_after=4)
    stretches, plain = [], 0
    for _ in range(200):
        k = policy.next_k()
        if k == 0:
            plain += 1
            continue
        if plain:
            stretches.append(plain)
        plain = 0
        policy.observe(k, 0)
    assert stretches == [4, 8, 16, 32, 32, 32, 32, 32]


def test_the_registry_maps_each_drafter_name_to_its_class():
    from macspec.api.drafters import DRAFTERS
    from macspec.core import drafters

    assert drafters.REGISTRY == {
        "model": drafters.ModelDrafter,
        "ngram": drafters.NgramDrafter,
        "model+ngram": drafters.HybridDrafter,
        "eagle": drafters.EagleDrafter,
        "eagle3": drafters.Eagle3Drafter,
        "mtp": drafters.MtpDrafter,
    }
    assert drafters.drafter_class("ngram") is NgramDrafter
    with pytest.raises(macspec.OptionError, match="no drafter 'medusa': one of eagle, eagle3,"):
        drafters.drafter_class("medusa")

    class Impostor:
        name = "ngram"

    with pytest.raises(macspec.OptionError, match="taken by NgramDrafter"):
        drafters.register(Impostor)
    assert drafters.REGISTRY["ngram"] is NgramDrafter
    assert DRAFTERS["ngram"] == NgramDrafter.summary  # load(drafter=...)'s choices


def test_each_choice_says_why():
    """decide() is where every choice is made: its Decision says what ran and why, with the
    figures (the expected speed against plain, the acceptance) behind it."""
    policy = AdaptiveK(k_max=4, costs=SLOW_DRAFT, probe_after=4)
    assert policy.decide(0) == Decision(0, "nothing to propose")
    assert policy.decide().reason == "priced to pay"  # the prior: worth a try
    for _ in range(6):
        policy.observe(4, 0)
    lost = policy.decide()
    assert (lost.k, lost.reason) == (0, "priced below plain") and policy.decision == lost
    assert lost.detail.startswith("model K=") and "x plain (acceptance 0." in lost.detail
    waits = [policy.decide() for _ in range(3)]
    assert [d.detail.split(", ")[-1] for d in waits] == ["probe in 3", "probe in 2", "probe in 1"]
    assert policy.decide().reason == "probe"
    launched = policy_at(0.5, Costs(plain_step=1.0, draft_step=0.0, extra=0.15, verify=CONCAVE))
    assert launched.decide(launched=True).reason == "a plain pass already running"


def test_trees_say_why_they_run():
    flat = Costs(plain_step=1.0, draft_step=0.01, extra=0.0, verify=((1, 1.0), (16, 1.05)))
    policy = adaptive_policy(3, flat, tree_nodes=8)
    assert policy.trees is not None
    # Before they have run, trees are priced as chains that pay the wider pass: a chain wins
    # till each shape's first probe, a few model rounds in.
    first = [policy.decide() for _ in range(Trees.FIRST_PROBE)]
    assert {d.reason for d in first} == {"priced to pay"}
    for shape in policy.trees.shapes:
        probe = policy.decide()
        assert probe == Decision(shape, "tree probe", "after 8 model rounds without it")
        policy.observe_tree(None, [1, 2, 3], 0.5)  # 4 tokens in half a plain step
    tree = policy.decide()
    assert isinstance(tree.k, TreeShape) and tree.reason == "tree priced faster"
    assert tree.detail.endswith("x the best chain's speed")
