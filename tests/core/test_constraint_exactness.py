"""The acceptance rule under a constraint, as the core runs it: the mask of
each position applies to p and to q, drafts are drawn from the masked q and the ratio and the
residual use that same masked q. The output is then distributed exactly as the target's own
constrained sampling (chi-square at T=1 against the distribution enumerated over the grammar's
language), equal to plain constrained decoding at T=0, and a rule that draws from the masked q
but divides by the unmasked one is shown to fail. The round itself is the engine's (`accept`,
`distribution`, `sample`); the logits are fixed random tables per position, not a model."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare
from support.tinymodels import DEFAULT_CHARS, write_char_tokenizer
from transformers import AutoTokenizer

from macspec.api.grammar import Grammar, Spec
from macspec.core.sampling import SamplingOptions, distribution, sample
from macspec.core.verify import accept

EOS = 2
GRAMMAR = 'start: "a" /[ab]/ /[bc]/ | "b" "c" /[ac]/ | "c"'
LANGUAGE = ["aab", "aac", "abb", "abc", "bca", "bcc", "c"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("chars")
    write_char_tokenizer(path, DEFAULT_CHARS)
    return AutoTokenizer.from_pretrained(str(path))


def tables(vocab: int, seed: int, temperature: float):
    """Target and draft logits per position (4 positions), clearly different from each other."""
    rng = np.random.default_rng(seed)
    p = mx.array(rng.normal(0, 2, (4, vocab)).astype(np.float32))
    q = mx.array(rng.normal(0, 2, (4, vocab)).astype(np.float32))
    return p, q, SamplingOptions(temperature=temperature)


def masked(logits: mx.array, mask: np.ndarray, opts: SamplingOptions) -> mx.array:
    return distribution(mx.where(mx.array(mask)[None], logits[None], -mx.inf), opts)


def speculate(g: Grammar, p_tab, q_tab, opts, key, k=2, broken=False) -> list[int]:
    """One answer by rounds of up to k drafts; `broken`: the ratio and the residual use the
    unmasked q although the drafts were drawn from the masked one."""
    out: list[int] = []
    while True:
        key, draft_key, accept_key = mx.random.split(key, 3)
        drafts, q_rows, raw_rows = [], [], []
        for sub in mx.random.split(draft_key, k):
            at = len(out) + len(drafts)
            q = masked(q_tab[at], g.allowed(drafts), opts)
            token = sample(q, sub).item()
            drafts, q_rows = drafts + [token], q_rows + [q]
            raw_rows.append(distribution(q_tab[at][None], opts))
            if token == EOS:
                break
        # p after each draft prefix, and after all of them unless a stop was drafted (nothing
        # follows a stop: that row is never read)
        rows = len(drafts) + (drafts[-1] != EOS)
        p = mx.concatenate(
            [masked(p_tab[len(out) + i], g.allowed(drafts[:i]), opts) for i in range(rows)]
            + [mx.zeros((1, p_tab.shape[1]))] * (len(drafts) + 1 - rows)
        )
        q = mx.concatenate(raw_rows if broken else q_rows)
        n, token = accept(p, q, mx.array(drafts), accept_key)
        emitted = drafts[: n.item()] + [token.item()]
        if EOS in emitted:
            emitted = emitted[: emitted.index(EOS)]
            g.commit(emitted)
            return out + emitted
        g.commit(emitted)
        out += emitted


def plain(g: Grammar, p_tab, opts, key) -> list[int]:
    out: list[int] = []
    while True:
        key, sub = mx.random.split(key)
        token = sample(masked(p_tab[len(out)], g.allowed(), opts), sub).item()
        if token == EOS:
            return out
        g.commit([token])
        out.append(token)


def exact(g: Grammar, p_tab, opts, prefix=()) -> dict[tuple[int, ...], float]:
    """The target's constrained distribution over whole answers, enumerated."""
    probs = np.array(masked(p_tab[len(prefix)], g.allowed(prefix), opts)[0])
    out: dict[tuple[int, ...], float] = {}
    for t in np.flatnonzero(probs):
        if t == EOS:
            out[tuple(prefix)] = out.get(tuple(prefix), 0.0) + probs[t]
            continue
        for seq, pr in exact(g, p_tab, opts, (*prefix, int(t))).items():
            out[seq] = out.get(seq, 0.0) + probs[t] * pr
    return out


def new(tok) -> Grammar:
    return Grammar.for_pair(Spec("grammar", GRAMMAR, "grammar"), tok, len(tok), [EOS])


def counts(tok, run, trials: int) -> dict[str, int]:
    seen: dict[str, int] = {}
    for i in range(trials):
        text = tok.decode(run(new(tok), mx.random.key(i)))
        seen[text] = seen.get(text, 0) + 1
    return seen


@pytest.mark.parametrize("broken", [False, True])
def test_speculation_under_a_grammar_samples_the_constrained_target(tok, broken):
    p_tab, q_tab, opts = tables(len(tok), 0, 1.0)
    want = {tok.decode(list(s)): pr for s, pr in exact(new(tok), p_tab, opts).items()}
    assert sorted(want) == sorted(LANGUAGE) and abs(sum(want.values()) - 1) < 1e-5
    trials = 2000
    seen = counts(tok, lambda g, key: speculate(g, p_tab, q_tab, opts, key, broken=broken), trials)
    assert set(seen) <= set(LANGUAGE)  # every answer is in the grammar's language, either way
    observed = [seen.get(s, 0) for s in LANGUAGE]
    expected = np.array([want[s] for s in LANGUAGE], dtype=np.float64)
    p_value = chisquare(observed, expected / expected.sum() * trials).pvalue
    if broken:
        assert p_value < 1e-6
    else:
        assert p_value > 1e-3


def test_greedy_speculation_under_a_grammar_is_plain_constrained_decoding(tok):
    for seed in range(6):
        p_tab, q_tab, opts = tables(len(tok), seed, 0.0)
        key = mx.random.key(seed)
        want = plain(new(tok), p_tab, opts, key)
        assert tok.decode(want) in LANGUAGE
        assert speculate(new(tok), p_tab, q_tab, opts, key) == want
