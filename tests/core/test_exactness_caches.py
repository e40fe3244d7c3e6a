"""Sampled output is distributed exactly as the target's own on a sliding-window model and a
hybrid recurrent model, through rounds that rewind their caches; and the same test fails when a
cache rewind is broken the way mlx-lm's trim silently is."""

import pytest
from support import archzoo
from support.exactness import chi_square, exact_joint, sample_prefixes

import macspec
from macspec.core import caches
from macspec.core.caches import recurrent

PROMPT = [3, 4, 5, 6, 3, 4, 7, 8]  # longer than the window (4): positions past it wrap
DEPTH = 4  # a plain step, then rounds of K=2
# Power (simulated from each broken rewind's distribution, measured at N=1000): with N=500 the
# broken window and the broken recurrent state each give p < 1e-5 in >= 99.8% of seed sets.
N = 500
OPTIONS = {"temperature": 1.0, "top_k": 6, "min_p": 0.02, "repetition_penalty": 1.3}

MODELS = {
    # arch: config changes (a 9-id vocabulary for exact enumeration), weight scale
    "gemma3_text": ({"vocab_size": 9, "sliding_window": 4}, {"embed": 3.0}),
    "qwen3_next": ({"vocab_size": 9}, {"head": 3.0}),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def arch_pair(request, tmp_path_factory):
    arch = request.param
    changes, scale = MODELS[arch]
    config = {**archzoo.ZOO[arch].config, **changes}
    root = tmp_path_factory.mktemp(arch)
    kw = {"seed": 3, "config": config, "scale": scale}
    target = archzoo.make_arch_model(root / "target", arch, **kw)
    draft = archzoo.make_arch_model(root / "draft", arch, perturb=0.3, **kw)
    pair = macspec.load(target, draft, drafter="model")
    pair.eos_token_ids = frozenset()  # every sample has the full depth
    return arch, pair


def test_speculative_distribution_matches_the_target(arch_pair):
    _, pair = arch_pair
    expected = exact_joint(pair, PROMPT, DEPTH, **OPTIONS)
    counts = sample_prefixes(pair, PROMPT, DEPTH, N, num_draft=2, adaptive=False, **OPTIONS)
    assert chi_square(expected, counts) > 1e-3


def _window_without_spare_slots(monkeypatch):
    """A ring of exactly the window that rewinds anyway: the overwritten positions come back
    as whatever the rejected drafts wrote (mlx-lm's RotatingKVCache trim, in effect)."""
    original = caches.WindowKVCache.__init__

    def init(self, window, max_step):
        original(self, window, 1)

    monkeypatch.setattr(caches.WindowKVCache, "__init__", init)
    monkeypatch.setattr(caches.WindowKVCache, "can_rewind_to", lambda self, n: n <= self.offset)


def _recurrent_state_not_restored(monkeypatch):
    """The state after all drafts is kept, rejected ones included (a no-op trim)."""
    monkeypatch.setattr(recurrent._Segment, "state_at", lambda self, slot, m: self.assigned[slot])


BROKEN = {"gemma3_text": _window_without_spare_slots, "qwen3_next": _recurrent_state_not_restored}


def test_the_test_detects_a_broken_cache_rewind(arch_pair, monkeypatch):
    arch, pair = arch_pair
    expected = exact_joint(pair, PROMPT, DEPTH, **OPTIONS)
    BROKEN[arch](monkeypatch)  # after load: the load-time probe would refuse the broken rewind
    # Every sample on the broken caches it makes, none restored from the good ones kept before.
    monkeypatch.setattr(pair, "prompt_cache", None)
    counts = sample_prefixes(pair, PROMPT, DEPTH, N, num_draft=2, adaptive=False, **OPTIONS)
    assert chi_square(expected, counts) < 1e-5
