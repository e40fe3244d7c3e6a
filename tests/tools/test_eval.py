"""`macspec eval` (tools/evaluate.py): perplexity and the distance from a reference, checked
against numpy on the same logits; KL 0 for a model against itself, a known positive KL for a
perturbed copy; bad input named."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model
from support.tinymodels import make_tiny_model

from macspec.base.errors import MacspecError, OptionError
from macspec.cli import main
from macspec.models import fidelity
from macspec.tools import evaluate

TEXT = "the quick brown fox jumps over the lazy dog, " * 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    a = make_tiny_model(root / "a", seed=3, scale=3.0)
    b = make_tiny_model(root / "b", seed=3, scale=3.0, perturb=0.8)
    text = root / "text.txt"
    text.write_text(TEXT)
    return a, b, text


def _numpy_kl(a, b, ids, context, skip):
    """The same measures from each model's own logits, in numpy (float64)."""
    ma, _ = load_model(a)
    mb, _ = load_model(b)
    kls, tops, nll = [], [], []
    for w in fidelity.windows(ids, context, skip):
        la = np.array(ma(mx.array(w)[None])[0], np.float64)
        lb = np.array(mb(mx.array(w)[None])[0], np.float64)
        pa = la - np.logaddexp.reduce(la, -1, keepdims=True)
        pb = lb - np.logaddexp.reduce(lb, -1, keepdims=True)
        pa, pb, nxt = pa[skip:-1], pb[skip:-1], np.array(w[skip + 1 :])
        kls.append((np.exp(pa) * (pa - pb)).sum(-1))
        tops.append(pa.argmax(-1) == pb.argmax(-1))
        nll.append(-pb[np.arange(len(nxt)), nxt])
    return np.concatenate(kls), np.concatenate(tops), np.concatenate(nll)


def test_a_model_against_itself_is_at_kl_zero(models):
    a, _, text = models
    r = evaluate.evaluate(str(a), str(text), reference=str(a), context=64)
    assert r.kl_mean == r.kl_p99 == r.kl_max == 0.0
    assert r.top1_agreement == 1.0 and r.perplexity == r.reference_perplexity > 1.0


def test_a_perturbed_copy_is_as_far_as_numpy_says(models, float32_kv):  # numpy: mlx-lm's model
    a, b, text = models
    r = evaluate.evaluate(str(b), str(text), reference=str(a), context=64, skip=4)
    from mlx_lm.utils import load_tokenizer

    ids = load_tokenizer(a).encode(TEXT)
    kl, top, nll = _numpy_kl(a, b, ids, 64, 4)
    assert r.positions == len(kl) > 100
    assert r.kl_mean == pytest.approx(kl.mean(), rel=1e-3) and r.kl_mean > 1e-2
    assert r.kl_p99 == pytest.approx(np.percentile(kl, 99), rel=1e-3)
    assert r.top1_agreement == pytest.approx(top.mean())
    assert r.perplexity == pytest.approx(math.exp(nll.mean()), rel=1e-5)


def test_the_command_prints_a_table_or_json(models, capsys):
    a, b, text = models
    assert main(["eval", str(b), str(text), "--reference", str(a), "--context", "64"]) == 0
    out = capsys.readouterr().out
    assert "mean KL(reference || model), nats" in out and "top-1 agreement" in out
    assert main(["eval", str(a), str(text), "--json", "--context", "64"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["perplexity"] > 1.0 and got["kl_mean"] is None


def test_bad_input_is_named(models, tmp_path):
    a, _, text = models
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(OptionError, match="holds no text"):
        evaluate.evaluate(str(a), str(empty))
    with pytest.raises(OptionError, match="nothing.txt: cannot read"):
        evaluate.evaluate(str(a), str(tmp_path / "nothing.txt"))
    with pytest.raises(OptionError, match="--context 4 must exceed --skip 4"):
        evaluate.evaluate(str(a), str(text), context=4)
    with pytest.raises(MacspecError, match="no-such-model"):
        evaluate.evaluate("no-such-model", str(text))
