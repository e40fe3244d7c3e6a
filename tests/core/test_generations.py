"""What the adaptive policy carries from one generation of a loaded pair to the next: the draft's
acceptance (as the next answer's starting estimate, outweighed within a few rounds), never a
fallback in progress. Exactness across such generations is checked against plain decoding."""

import pytest

import macspec
from macspec.core import Observations
from macspec.core.adaptive import AdaptiveK
from macspec.core.policy import Costs

# Drafting costs half a plain step: at the default prior (0.6 at position 1) every K loses.
DEAR_DRAFT = Costs(plain_step=1.0, draft_step=0.5, extra=0.2)


def test_a_new_generation_starts_from_the_pairs_acceptance():
    kept: dict = {}
    first = AdaptiveK(k_max=4, costs=DEAR_DRAFT, kept=kept)
    first.next_k()
    for _ in range(10):  # the draft was accepted throughout
        first.observe(4, 4)
    assert AdaptiveK(k_max=4, costs=DEAR_DRAFT).next_k() == 0  # no history: the prior loses
    second = AdaptiveK(k_max=4, costs=DEAR_DRAFT, kept=kept)
    assert second.next_k() == 4
    assert second.arms[None].positions[0].count == AdaptiveK.CARRY
    before = kept[None].positions[0].count
    second.observe(4, 4)  # its rounds go on to the generation after it
    assert kept[None].positions[0].count == pytest.approx(0.98 * before + 1)


def test_one_poor_answer_does_not_decide_the_next_ones_start():
    kept: dict = {}
    good = AdaptiveK(k_max=4, costs=DEAR_DRAFT, kept=kept)
    good.next_k()
    for _ in range(40):
        good.observe(4, 4)
    poor = AdaptiveK(k_max=4, costs=DEAR_DRAFT, kept=kept)
    poor.next_k()
    for _ in range(5):  # a prompt the draft does not know
        poor.observe(4, 0)
    assert poor.next_k() == 0
    assert AdaptiveK(k_max=4, costs=DEAR_DRAFT, kept=kept).next_k() == 4


def test_a_kept_acceptance_is_outweighed_by_the_new_content():
    kept: dict = {}
    first = AdaptiveK(k_max=4, costs=DEAR_DRAFT, kept=kept)
    first.next_k()
    for _ in range(10):
        first.observe(4, 4)
    second = AdaptiveK(k_max=4, costs=DEAR_DRAFT, kept=kept)
    assert second.next_k() == 4
    for _ in range(3):  # this answer's drafts are all rejected
        second.observe(4, 0)
    assert second.next_k() == 0


def test_a_poorer_history_than_the_prior_is_not_carried():
    kept: dict = {}
    first = AdaptiveK(k_max=4, costs=Costs(plain_step=1.0, draft_step=0.05, extra=0.05), kept=kept)
    first.next_k()
    for _ in range(10):  # the last answer's drafts were all rejected
        first.observe(4, 0)
    second = AdaptiveK(k_max=4, costs=first.costs, kept=kept)
    assert second.next_k() >= 1  # the prior's start: cheap drafts are tried
    assert second.arms[None].positions == []


def test_a_fallback_is_not_carried_into_the_next_generation():
    kept: dict = {}
    first = AdaptiveK(k_max=4, costs=DEAR_DRAFT, kept=kept)
    first.next_k()
    for _ in range(10):
        first.observe(4, 4)
    first.backoff(None).left, first.backoff(None).wait = 20, 32  # as after losing probes
    second = AdaptiveK(k_max=4, costs=DEAR_DRAFT, kept=kept)
    assert second.next_k() == 4
    assert second.backoff(None).wait == second.probe_after


def test_generations_of_one_pair_keep_its_acceptance_and_equal_plain_decoding(pair, monkeypatch):
    monkeypatch.setattr(pair, "observations", Observations())
    made = []
    for prompt in ("Once upon", "abcabcabc", "Once upon"):
        plain = macspec.generate(pair, prompt, max_tokens=40, speculative=False)
        r = macspec.generate(pair, prompt, max_tokens=40, num_draft=4)
        assert r.tokens == plain.tokens
        made.append(pair.observations.acceptance.get(None))
    assert made[0] is not None and made[0].positions  # the draft's rounds were kept
