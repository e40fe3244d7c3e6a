"""pair.share: more pairs over one loaded target and draft (the bench's methods), each drafting
as a pair loaded on its own would."""

import pytest

import macspec
from macspec.api.pair import share
from macspec.base.errors import OptionError

PROMPT = "the quick brown fox jumps over the lazy dog. the quick brown"


@pytest.fixture(scope="module")
def model_pair(tiny_dirs):
    return macspec.load(*tiny_dirs, drafter="model", measure=False)


def _run(pair):
    res = macspec.generate(pair, PROMPT, max_tokens=24, temperature=0, num_draft=3, adaptive=False)
    return res.tokens, res.stats.drafted, res.stats.accepted


@pytest.mark.parametrize(("drafter", "kind"), [(None, "model+ngram"), ("ngram", "ngram")])
def test_a_shared_pair_drafts_as_one_loaded_alone(tiny_dirs, model_pair, drafter, kind):
    shared = share(model_pair, drafter)
    assert shared.target is model_pair.target  # one copy of the weights
    assert shared.drafter_kind == kind
    assert (shared.draft is model_pair.draft) == (drafter is None)
    assert shared.timing is not model_pair.timing
    assert shared.prompt_cache is not model_pair.prompt_cache
    alone = macspec.load(tiny_dirs[0], None if drafter else tiny_dirs[1], drafter=drafter)
    assert alone.drafter_kind == kind
    assert _run(shared) == _run(alone)
    assert _run(shared)[1] > 0  # it did draft


def test_the_shared_pairs_leave_the_first_as_it_was(model_pair):
    before = _run(model_pair)
    share(model_pair, None), share(model_pair, "ngram")
    assert model_pair.drafter_kind == "model" and model_pair.draft is not None
    assert _run(model_pair) == before


def test_what_cannot_be_shared_is_an_option_error(model_pair):
    with pytest.raises(OptionError, match="already has an n-gram copy"):
        share(share(model_pair, None), None)
    with pytest.raises(OptionError, match="needs a draft model"):
        share(model_pair, "model")
    with pytest.raises(OptionError, match="unknown drafter"):
        share(model_pair, "eagle")
