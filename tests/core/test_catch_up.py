"""A draft model behind the target after plain steps catches up before it drafts, and that
catch-up is timed apart: a policy judges a speculative round by its own time, not by the length
of the plain stretch before it (else every probe after a long stretch looks like a loss)."""

import pytest

import macspec
import macspec.api.stream as api
from macspec.core.drafters.model import ModelDrafter
from macspec.core.policy import Policy

PROMPT = "the quick brown fox jumps over the lazy dog and"


class Pattern(Policy):
    """Plain steps in stretches of `plain`, then one round of `k` drafts; records every
    observed (k, tokens, seconds)."""

    def __init__(self, plain: int, k: int):
        self.plain, self.k, self.max_k, self.n, self.times = plain, k, k, 0, []

    def next_k(self, label=None, launched=False, position=0):
        self.n += 1
        return self.k if self.n % (self.plain + 1) == 0 else 0

    def observe(self, k, accepted):
        pass

    def observe_time(self, k, tokens, seconds):
        self.times.append((k, tokens, seconds))

    def expects_plain(self):
        return self.n % (self.plain + 1) != self.plain


@pytest.fixture
def model_pair(tiny_dirs):
    return macspec.load(*tiny_dirs, drafter="model", measure=False)


@pytest.fixture
def pattern(monkeypatch):
    made = []

    def policy(opts, pair):
        made.append(Pattern(plain=6, k=2))
        return made[-1]

    monkeypatch.setattr(api, "_policy", policy)
    return made


def test_after_plain_steps_the_draft_catches_up_and_the_answer_is_plain_decodings(
    model_pair, pattern, monkeypatch
):
    caught = []
    take = ModelDrafter.take_catch_up
    monkeypatch.setattr(ModelDrafter, "take_catch_up", lambda d: caught.append(take(d)) or 0.0)
    plain = macspec.generate(model_pair, PROMPT, max_tokens=40, speculative=False)
    macspec.generate(model_pair, PROMPT, max_tokens=2)  # the pair's costs measured, once
    caught.clear()
    res = macspec.generate(model_pair, PROMPT, max_tokens=40, temperature=0)
    assert res.tokens == plain.tokens
    spec = [t for t in pattern[-1].times if t[0]]
    assert len(spec) >= 4 and res.stats.drafted > 0
    # Six plain steps behind before every speculative round (the first: the prompt too, which
    # the draft reads only then, after the first token): each of them caught up first.
    assert sum(c > 0 for c in caught) == len(spec)


def test_a_rounds_observed_time_leaves_out_the_catch_up(model_pair, pattern, monkeypatch):
    catch_up = ModelDrafter._catch_up

    def slow(d):  # a catch-up that takes "forever"
        d._caught_up += 1e9 if len(d.pending) > 2 else 0.0
        catch_up(d)

    monkeypatch.setattr(ModelDrafter, "_catch_up", slow)
    macspec.generate(model_pair, PROMPT, max_tokens=40, temperature=0)
    times = pattern[-1].times
    assert {s for k, _, s in times if k} == {0.0}  # all of it was catch-up here
    assert all(s > 0 for k, _, s in times if not k)
