"""The adaptive policy checked against observed round times (core/observed.py): it falls back to
plain decoding or a cheaper K where speculation loses, probes, returns where it pays, and never
moves the output distribution. Round times are injected: no test here depends on a clock."""

import logging

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

import macspec
import macspec.api.stream as api
import macspec.core.verify as verify
from macspec.core import FixedK, Observations, Observed
from macspec.core.observed import TIME_DECAY
from macspec.core.tally import Decision, Tally


def play(policy: Observed, rounds: int, seconds, tokens) -> list[int]:
    """`rounds` rounds; each K chosen is run for `seconds(k)` and emits `tokens(k)` ids."""
    chosen = []
    for _ in range(rounds):
        k = policy.next_k()
        policy.observe_time(k, tokens(k) if k else 1, seconds(k) if k else 1.0)
        chosen.append(k)
    return chosen


def test_falls_back_to_plain_when_verification_loses_and_returns_when_it_pays():
    policy = Observed(Proposes(4))
    policy.observe_time(0, 1, 1.0)  # the first token: a plain step of 1 s
    # Verifying 4 drafts costs 4 steps and keeps 1 of them: 2 s a token against plain's 1 s.
    costly = play(policy, 2 + 8 + 1 + 16 + 1, lambda k: 4.0, lambda k: 2)
    # A first look (two rounds), 8 plain steps, a losing probe, then 16 plain steps.
    assert costly == [4, 4] + [0] * 8 + [4] + [0] * 16 + [4]
    # Verification got cheap (a faster kernel, a copy the draft knows): 0.4 s a token.
    cheap = play(policy, 40, lambda k: 2.0, lambda k: 5)
    assert cheap == [0] * 32 + [4] * 8  # the next probe, after 32 steps, wins: it stays
    assert policy.backoff(None).wait == Observed.FIRST_WAIT


def test_probes_wait_at_most_max_wait_steps():
    policy = Observed(Proposes(2))
    policy.observe_time(0, 1, 1.0)
    chosen = play(policy, 400, lambda k: 3.0, lambda k: 1)
    stretches = [len(s) for s in "".join("x" if k else "." for k in chosen).split("x")[1:-1]]
    assert stretches == [0, 8, 16, 32] + [64] * (len(stretches) - 4)  # after a first look


def test_a_cheaper_k_that_pays_is_run_in_place_of_a_losing_one():
    seen = Observations()
    seen.plain.add(1.0, 1)
    seen.arms[(None, 1)] = Tally(TIME_DECAY, 1.2, 2.0, rounds=1.0)  # 0.6 s a token: wins
    seen.arms[(None, 2)] = Tally(TIME_DECAY, 1.4, 1.5, rounds=1.0)  # 0.93 s: wins, less
    policy = Observed(Proposes(4), seen)
    for _ in range(Observed.FIRST_LOOK):  # K=4 never run: a first look
        assert policy.next_k() == 4
        policy.observe_time(4, 2, 4.0)  # 2 s a token: loses
    assert [policy.next_k() for _ in range(3)] == [1, 1, 1]
    assert not policy.expects_plain()


def test_a_proposed_k_that_pays_runs_though_a_cheaper_arm_looked_faster():
    seen = Observations()
    seen.plain.add(1.0, 1)
    seen.arms[(None, 1)] = Tally(TIME_DECAY, 1.0, 2.0, rounds=1.0, runs=5)  # 0.5 s a token
    seen.arms[(None, 4)] = Tally(TIME_DECAY, 1.6, 2.0, rounds=1.0, runs=5)  # 0.8 s: pays
    policy = Observed(Proposes(4), seen)
    assert [policy.next_k() for _ in range(3)] == [4, 4, 4]


def test_a_cheaper_k_in_place_of_a_losing_one_gives_way_to_a_probe():
    seen = Observations()
    seen.plain.add(1.0, 1)
    seen.arms[(None, 1)] = Tally(TIME_DECAY, 1.0, 2.0, rounds=1.0, runs=5)
    seen.arms[(None, 4)] = Tally(TIME_DECAY, 4.0, 2.0, rounds=1.0, runs=5)  # 2 s: loses
    policy = Observed(Proposes(4), seen)
    # K=1 stands in, and after FIRST_WAIT such rounds K=4 is timed again (its tally may be old).
    chosen = play(policy, Observed.FIRST_WAIT + 1, lambda k: 1.0 if k == 1 else 0.8, lambda k: 2)
    assert chosen == [1] * Observed.FIRST_WAIT + [4]
    assert policy.next_k() == 4  # the probe's 0.4 s a token (the old rounds faded) pays


def test_a_new_generation_after_a_poor_one_probes_within_first_wait():
    seen = Observations()
    poor = Observed(Proposes(2), seen)
    poor.observe_time(0, 1, 1.0)
    play(poor, 300, lambda k: 3.0, lambda k: 1)  # losing probes: waits at MAX_WAIT
    assert poor.backoff(None).wait == Observed.MAX_WAIT
    # The next prompt's draft pays: its generation probes as a first loss would.
    chosen = play(Observed(Proposes(2), seen), Observed.FIRST_WAIT + 2, lambda k: 0.5, lambda k: 3)
    assert chosen == [0] * Observed.FIRST_WAIT + [2, 2]
    assert seen.arms[(None, 2)].runs > 2  # its tallies were kept


def test_arms_are_kept_per_label():
    policy = Observed(Proposes(3))
    policy.observe_time(0, 1, 1.0)
    for _ in range(3):  # copies of long matches pay, the draft model loses
        for label, seconds, tokens in ((16, 1.2, 4), (None, 3.0, 1)):
            k = policy.next_k(label)
            policy.observe_time(k, tokens if k else 1, seconds if k else 1.0)
    assert policy.next_k(16) == 3 and policy.next_k(None) == 0


def test_a_vetoed_stretch_expects_plain_steps_until_a_probe_is_due():
    policy = Observed(Proposes(2))
    policy.observe_time(0, 1, 1.0)
    for _ in range(Observed.FIRST_LOOK):  # the first look loses
        policy.observe_time(policy.next_k(), 1, 3.0)
    expected = []
    for _ in range(Observed.FIRST_WAIT):
        assert policy.next_k() == 0
        expected.append(policy.expects_plain())
    assert expected == [True] * (Observed.FIRST_WAIT - 1) + [False]  # the next is a probe
    assert policy.next_k() == 2


def test_a_zero_proposal_stays_a_plain_step():
    policy = Observed(FixedK(3))
    assert policy.next_k(0) == 0 and policy.next_k(None) == 3
    assert policy.max_k == 3


def test_a_vetoed_round_says_why_and_the_generation_counts_the_reasons(caplog):
    policy = Observed(Proposes(2))
    policy.observe_time(0, 1, 1.0)
    with caplog.at_level(logging.DEBUG, logger="macspec.core"):
        chosen = play(policy, 2 + Observed.FIRST_WAIT + 1, lambda k: 3.0, lambda k: 1)
    assert chosen == [2, 2] + [0] * Observed.FIRST_WAIT + [2]
    assert policy.decision == Decision(2, "probe of a slower arm", policy.decision.detail)
    assert policy.decision.detail == "model K=2 took 3.00x plain's time a token over 2 rounds"
    assert policy.reasons.plain_steps() == (("slower than plain here", Observed.FIRST_WAIT),)
    # One line where the decision changed (to drafting, to plain steps, to drafting), not one
    # a round.
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("policy: ")]
    assert lines == [
        "policy: K=2: fixed",
        "policy: plain: slower than plain here (model K=2 took 3.00x plain's time a token over 2"
        f" rounds, probe in {Observed.FIRST_WAIT})",
        f"policy: K=2: probe of a slower arm ({policy.decision.detail})",
    ]


# ---------------------------------------------------------------- exactness while switching


class Injected(Observed):
    """Observed fed made-up round times (a spec round of k drafts takes 1 + k plain steps),
    so that arms switch mid-generation on what each round accepted."""

    def observe_time(self, k, tokens, seconds):
        super().observe_time(k, tokens, 1.0 + (k if isinstance(k, int) else k.depth))


def switching(monkeypatch, cheaper: bool) -> list[Observed]:
    """Every generation from now on uses an Injected policy over fixed K (num_draft); with
    `cheaper`, K=1 is known to pay, so a losing K turns into K=1 rather than plain steps."""
    made = []

    def policy(opts, pair):
        seen = Observations()
        seen.plain.add(1.0, 1)
        # K=num_draft has had its first look and kept up with plain: it runs until it loses.
        seen.arms[(None, opts.num_draft)] = Tally(TIME_DECAY, 1.0, 1.0, 1.0, Observed.FIRST_LOOK)
        if cheaper:
            seen.arms[(None, 1)] = Tally(TIME_DECAY, 1.0, 2.0, rounds=1.0)
        made.append(Injected(FixedK(opts.num_draft), seen))
        return made[-1]

    monkeypatch.setattr(api, "_policy", policy)
    return made


@pytest.mark.parametrize("cheaper", [False, True])
def test_switching_arms_greedy_equals_plain(pair, monkeypatch, cheaper):
    made = switching(monkeypatch, cheaper)
    ks = []
    for prompt in ("Switch", "abcabcabc"):
        plain = macspec.generate(pair, prompt, max_tokens=60, speculative=False)
        events = list(macspec.stream_generate(pair, prompt, max_tokens=60, num_draft=4))
        assert [t for e in events for t in e.emitted] == plain.tokens
        ks += [e.num_draft for e in events]
        # With a cheaper K known to pay, losing K=4 rounds turn into K=1 rounds.
        seen = made[-1].seen.arms.get((None, 1))
        assert (seen is not None and seen.rounds > 1.0) == cheaper
    assert any(a and not b for a, b in zip(ks, ks[1:], strict=False))  # speculation, then plain
    assert any(b and not a for a, b in zip(ks[1:], ks[2:], strict=False))  # and back


def test_switching_arms_distribution_matches_target(small_pair, monkeypatch):
    """At T=1 the K of each round depends on what the rounds before accepted: K=2, then K=1
    (a cheaper K) or plain steps, within the first DEPTH tokens."""
    made = switching(monkeypatch, cheaper=True)
    options = {"temperature": 1.0}
    expected = exact_joint(small_pair, PROMPT, DEPTH, **options)
    counts = sample_prefixes(small_pair, PROMPT, DEPTH, N, num_draft=2, **options)
    assert chi_square(expected, counts) > 1e-3
    # Both switches happened often: to K=1 (from a seeded 1 round), to plain (beyond the seeded
    # step and the first token's).
    assert sum(p.seen.arms[(None, 1)].rounds > 1.0 for p in made) > N // 10
    assert sum(p.seen.plain.rounds > 1.81 for p in made) > N // 10


def test_switching_arms_distribution_test_detects_a_broken_rule(small_pair, monkeypatch):
    switching(monkeypatch, cheaper=True)
    monkeypatch.setattr(verify, "accept", resample_from_p)
    expected = exact_joint(small_pair, PROMPT, DEPTH, temperature=1.0)
    counts = sample_prefixes(small_pair, PROMPT, DEPTH, N, num_draft=2, temperature=1.0)
    assert chi_square(expected, counts) < 1e-5


def test_stats_count_rounds_and_tokens_per_arm(pair, monkeypatch):
    switching(monkeypatch, cheaper=True)
    r = macspec.generate(pair, "Arms", max_tokens=40, num_draft=3)
    s = r.stats
    assert sum(n for _, _, n, _ in s.arms) == s.rounds
    assert sum(t for _, _, _, t in s.arms) == s.generated_tokens
    assert s.arms[0][:2] == ("plain", 0)
    assert {name for name, k, _, _ in s.arms if k} <= {"model", "ngram"}
    assert s.arms_line().startswith(f"plain {s.arms[0][2]}, ")


def test_stats_say_why_the_plain_steps_were_plain(pair, monkeypatch):
    switching(monkeypatch, cheaper=False)
    r = macspec.generate(pair, "Switch", max_tokens=60, num_draft=4)
    reasons = dict(r.stats.plain_reasons)
    assert reasons["slower than plain here"] > 0
    assert sum(reasons.values()) <= r.stats.arms[0][2]  # (the first token's step has none)
    assert f"slower than plain here {reasons['slower than plain here']}" in r.stats.plain_line()
    fixed = macspec.generate(pair, "Switch", max_tokens=20, num_draft=4, adaptive=False)
    assert fixed.stats.plain_reasons == () and fixed.stats.plain_line() == ""
