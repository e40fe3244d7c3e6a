"""`macspec distill --corpus` (teacher-forced data from text files) and `--kind eagle3` (a draft
in EAGLE-3's published architecture, written in vLLM speculators' layout and loaded back by the
code that runs downloaded drafts), on a tiny target."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from support.exactness import chi_square, exact_joint, sample_prefixes
from support.tinymodels import make_tiny_model
from support.unrolled import assert_unrolled_steps_attend_as_drafting_does

import macspec
from macspec.base.errors import ModelError, OptionError
from macspec.core.drafters.eagle3 import Eagle3Draft, Eagle3Drafter
from macspec.models.eagle3 import detect, load
from macspec.models.store import model_info
from macspec.tools import distill as d
from macspec.tools.distill.corpus import corpus_rows
from macspec.tools.distill.data import Dataset
from macspec.tools.distill.eagle3_kind import eagle3_taps

RUN = {"max_new": 48, "eval_tokens": 8, "progress": False, "vocab": 40, "lr": 1e-2}


def _corpus(root, files=200, chars="abcde "):
    """Many small text files (the tiny tokenizer's own characters), one in a subdirectory, and
    a file that is not text."""
    rng = np.random.default_rng(0)
    corpus = root / "corpus"
    (corpus / "pkg").mkdir(parents=True)
    words = ["".join(rng.choice(list(chars.strip()), 3)) for _ in range(12)]
    for n in range(files):
        text = " ".join(rng.choice(words, 12 + n % 7)) + "\n"
        (corpus / ("pkg" if n == 0 else "") / f"note{n}.txt").write_text(text)
    (corpus / "image.png").write_bytes(bytes(range(256)) * 4)  # not text: skipped by suffix
    return corpus


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill-eagle3")
    target = make_tiny_model(root / "target", seed=0, hidden=48, tie=False, scale=2.0, context=512)
    corpus = _corpus(root)
    out = d.distill(
        str(target),
        str(root / "draft"),
        kind="eagle3",
        corpus=str(corpus),
        tokens=2500,
        epochs=6,
        **RUN,
    )
    return target, corpus, out


def test_the_draft_is_a_published_eagle3_checkpoint_loaded_as_one(run):
    target, _, out = run
    config = json.loads((out / "config.json").read_text())
    assert detect(out) == "speculators" and config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == 40
    ckpt = load(out)  # the reader of downloaded drafts: d2t / t2d checked there
    assert ckpt.d2t.shape == (40,) and len(set(ckpt.d2t.tolist())) == 40
    pair = macspec.load(str(target), str(out), drafter="model")
    assert isinstance(pair.make_drafter(False), Eagle3Drafter)
    report = json.loads((out / "report.json").read_text())
    assert report["kind"] == "eagle3" and report["data"]["tokens"] > 2000
    info = model_info(out)  # `macspec models`: its kind, and the acceptance in words
    assert info.architecture == "eagle3" and info.acceptance.startswith("chat K=4: ")


@pytest.mark.parametrize("drafter", ["model", None], ids=["model", "hybrid"])
@pytest.mark.parametrize("shape", [None, "tree"])
def test_greedy_equals_plain_with_the_distilled_draft(run, drafter, shape):
    target, _, out = run
    pair = macspec.load(str(target), str(out), drafter=drafter)
    assert pair.drafter_kind == ("eagle3" if drafter else "eagle3+ngram")
    plain = macspec.generate(pair, [3, 9, 4, 7], max_tokens=40, speculative=False).tokens
    opts = {"tree_nodes": 6} if shape else {"num_draft": 3}
    spec = macspec.generate(pair, [3, 9, 4, 7], max_tokens=40, **opts).tokens
    assert spec == plain


def test_training_raised_held_out_agreement(run):
    report = json.loads((run[2] / "report.json").read_text())
    before, after = report["agreement_top1_by_position"].values()
    assert after[0] > before[0] + 0.2 and after[1] > before[1] + 0.1, (before, after)


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """A target of 9 output rows (7 the tokenizer knows) and a distilled draft knowing 5."""
    root = tmp_path_factory.mktemp("eagle3-small")
    kw = {"chars": "abcd", "scale": 8.0, "vocab_rows": 9, "tie": False, "layers": 8}
    target = make_tiny_model(root / "target", seed=3, **kw)
    corpus = _corpus(root, files=20, chars="abcd ")
    small = {**RUN, "vocab": 5, "tokens": 1000, "epochs": 2, "eval_tokens": 4}
    draft = d.distill(str(target), str(root / "draft"), kind="eagle3", corpus=str(corpus), **small)
    pair = macspec.load(str(target), str(draft), drafter="model")
    pair.eos_token_ids = frozenset()  # every sequence has the full length: exact tables
    return pair


@pytest.mark.parametrize("broken", [False, True])
def test_distribution_at_temperature_one_with_the_reduced_vocabulary(
    small_pair, broken, monkeypatch
):
    pair = small_pair
    assert pair.make_drafter(False).parts.vocab_ids.size < pair.vocab_size
    if broken:  # q reported one target id above where it was drawn: must be caught

        def off_by_one(self, small):
            full = mx.zeros((small.shape[0], self.vocab_size), dtype=mx.float32)
            ids = (self.parts.vocab_ids[None] + 1) % self.vocab_size
            return mx.put_along_axis(full, mx.broadcast_to(ids, small.shape), small, axis=-1)

        monkeypatch.setattr(Eagle3Drafter, "_full", off_by_one)
    prompt = [3, 4, 5, 3]
    expected = exact_joint(pair, prompt, 3, temperature=1.0)
    counts = sample_prefixes(pair, prompt, 3, 600, num_draft=2, adaptive=False, temperature=1.0)
    p = chi_square(expected, counts)
    assert (p < 1e-3) if broken else (p > 1e-3), p


def test_export_folds_the_feature_scale_into_fc_exactly(tmp_path):
    from macspec.tools.distill.eagle3_kind import TrainableEagle3, eagle3_config

    target = make_tiny_model(tmp_path / "t", seed=0, hidden=48, layers=4)
    pair = macspec.load(str(target))
    taps = eagle3_taps(4)
    config = eagle3_config(pair, taps, 1, 64, list(range(30)))
    width = (len(taps) + 1) * 48
    scale = mx.exp(mx.random.normal((width,), key=mx.random.key(1)) * 3)  # spread like outliers
    trained = TrainableEagle3(config, taps, scale)
    published = Eagle3Draft(config, taps, tuple(range(len(taps))))
    published.load_weights(list(trained.checkpoint(list(range(30))).weights.items()), strict=True)
    features = mx.random.normal((1, 5, width), key=mx.random.key(2)) * scale
    assert mx.allclose(trained.state(features), published.state(features), rtol=1e-4, atol=1e-4)


def test_unrolled_eagle3_steps_attend_as_drafting_does(tmp_path):
    """Training's unrolled steps equal what the EAGLE-3 drafter computes with its cache."""

    from macspec.tools.distill.eagle3_kind import TrainableEagle3, eagle3_config

    target = make_tiny_model(tmp_path / "t", seed=0, hidden=48, layers=4)
    pair = macspec.load(str(target))
    taps = eagle3_taps(4)
    mx.random.seed(3)
    width = (len(taps) + 1) * 48
    draft = TrainableEagle3(eagle3_config(pair, taps, 2, 64, list(range(30))), taps, mx.ones(width))
    assert_unrolled_steps_attend_as_drafting_does(draft, pair.target, taps, 2)


def test_corpus_shards_hold_whole_files_out_and_count_the_text_only(run):
    target, corpus, out = run
    work = out.parent / f".distill-{out.name}"
    data = Dataset(work / "data", 48, layers=True)
    pair = macspec.load(str(target))
    rows = corpus_rows(pair, str(corpus), 4000, 48, 0)
    # Loss counts from the first id of text: position t predicts id t + 2.
    for r, row in zip(range(len(data)), rows, strict=False):
        assert data.first[r] == len(row.prompt) - 2
        assert data.ids[r].tolist() == row.prompt + row.text
    train, held = data.split(every=3)
    assert held and train
    held_groups = {data.prompt[r] for r in held}
    assert not held_groups & {data.prompt[r] for r in train}  # a file is held out whole
    assert np.isfinite(data.feats[0]).all()


def test_corpus_rows_are_seeded_and_grow_with_tokens(tmp_path):
    target = make_tiny_model(tmp_path / "t", seed=0, hidden=32)
    pair = macspec.load(str(target))
    corpus = _corpus(tmp_path)
    few = corpus_rows(pair, str(corpus), 300, 40, seed=1)
    more = corpus_rows(pair, str(corpus), 900, 40, seed=1)
    assert more[: len(few)] == few and len(more) > len(few)
    assert corpus_rows(pair, str(corpus), 300, 40, seed=2) != few
    assert all(32 <= len(r.text) <= 40 for r in more)
    assert {r.group for r in more} > {r.group for r in few}


def test_a_resumed_run_keeps_the_ids_its_head_was_trained_over(run, tmp_path):
    target, corpus, _ = run

    def distill(out, tokens, **kw):
        return d.distill(
            str(target), str(out), kind="eagle3", corpus=str(corpus), tokens=tokens,
            **kw, **{**RUN, "epochs": 1},
        )  # fmt: skip

    first = distill(tmp_path / "draft", 600)
    ckpt = tmp_path / ".distill-draft" / "checkpoints"
    chosen = json.loads((ckpt / "vocab.json").read_text())
    assert chosen == load(first).d2t.tolist()
    # Other ids than the data would give: a resumed run with more data keeps these, as its
    # head's rows were trained for them (choosing afresh would scramble the head).
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    other = sorted(set(range(vocab)) - set(chosen[-5:]))[: len(chosen)]
    assert other != chosen
    (ckpt / "vocab.json").write_text(json.dumps(other))
    again = distill(first, 1500, resume=True, force=True)
    assert load(again).d2t.tolist() == other
    (ckpt / "vocab.json").unlink()  # a checkpoint whose ids are unknown: refused
    with pytest.raises(ModelError, match=r"checkpoint\.safetensors has no readable vocab\.json"):
        distill(first, 2000, resume=True, force=True)


def test_bad_corpora_and_resumes_are_refused_by_name(run, tmp_path):
    target, corpus, out = run
    small = {**RUN, "tokens": 200, "epochs": 1}
    with pytest.raises(ModelError, match="nowhere.*does not exist"):
        d.distill(str(target), str(tmp_path / "a"), corpus=str(tmp_path / "nowhere"), **small)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "x.bin").write_bytes(b"\0\1")
    with pytest.raises(ModelError, match="holds no text files"):
        d.distill(str(target), str(tmp_path / "b"), corpus=str(empty), **small)
    (empty / "blank.txt").write_text("  \n")
    with pytest.raises(ModelError, match="holds no text"):
        d.distill(str(target), str(tmp_path / "c"), corpus=str(empty), **small)
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    # A resumed run with other options: refused naming run.json and the setting.
    with pytest.raises(ModelError, match=r"run\.json.*kind='eagle3'"):
        d.distill(
            str(target),
            str(out),
            corpus=str(corpus),
            force=True,
            resume=True,
            tokens=4000,
            **{**RUN, "epochs": 1},
        )
    other = make_tiny_model(tmp_path / "other", seed=1, hidden=48, tie=False, context=512)
    with pytest.raises(ModelError, match="target="):
        d.distill(
            str(other),
            str(out),
            kind="eagle3",
            corpus=str(corpus),
            force=True,
            resume=True,
            tokens=4000,
            **{**RUN, "epochs": 1},
        )


def test_init_reads_a_published_draft_back_computing_what_it_did(run):
    """--init of an EAGLE-3 draft: read as a downloaded one, it starts out computing exactly what
    that draft computes, whatever feature scale the new data gives, and exports back to it."""
    from macspec.tools.distill.eagle3_kind import read_init

    target, _, out = run
    pair = macspec.load(str(target))
    draft, ids, path = read_init(str(out), pair)
    ckpt = load(out)
    assert path == out.resolve() and ids == ckpt.d2t.tolist()
    taps = draft.feature_layers
    published = Eagle3Draft(ckpt.config, taps, tuple(range(len(taps))))
    published.load_weights(list(ckpt.weights.items()), strict=True)
    width = (len(taps) + 1) * 48
    scale = mx.exp(mx.random.normal((width,), key=mx.random.key(1)) * 3)
    continued = draft.with_scale(scale)
    assert mx.array_equal(continued.feature_scale, scale).item()
    features = mx.random.normal((1, 5, width), key=mx.random.key(2)) * scale
    g = continued.state(features)
    assert mx.allclose(g, published.state(features), rtol=1e-4, atol=1e-4).item()
    assert mx.allclose(continued.fc.weight, published.fc.weight).item() is False  # rescaled
    back = continued.checkpoint(ids).weights
    for name, value in ckpt.weights.items():
        assert mx.allclose(back[name], value, rtol=1e-5, atol=1e-6).item(), name


def test_init_continues_an_eagle3_draft_on_the_targets_own_answers(run, tmp_path):
    """A corpus-trained EAGLE-3 draft continued on sampled continuations (no --corpus): the same
    ids, the start recorded, and it starts from its weights, not afresh."""
    target, _, out = run
    small = {**RUN, "epochs": 1, "max_new": 24, "tokens": 800}
    fresh = d.distill(str(target), str(tmp_path / "fresh"), kind="eagle3", **small)
    more = d.distill(str(target), str(tmp_path / "more"), kind="eagle3", init=str(out), **small)
    assert load(more).d2t.tolist() == load(out).d2t.tolist()  # its own ids, not --vocab's choice
    report = json.loads((more / "report.json").read_text())
    assert report["kind"] == "eagle3" and Path(report["init"]) == out.resolve()
    started = report["agreement_top1_by_position"]["before"]
    afresh = json.loads((fresh / "report.json").read_text())["agreement_top1_by_position"]
    assert started[0] > afresh["before"][0] + 0.1, (started, afresh["before"])
    pair = macspec.load(str(target), str(more), drafter="model")
    plain = macspec.generate(pair, [3, 9, 4, 7], max_tokens=40, speculative=False).tokens
    assert macspec.generate(pair, [3, 9, 4, 7], max_tokens=40, num_draft=3).tokens == plain


def test_init_of_another_kind_or_shape_is_refused_by_name(run, tmp_path):
    target, corpus, out = run
    small = {**RUN, "epochs": 1, "tokens": 200, "corpus": str(corpus)}
    with pytest.raises(ModelError, match="cannot read the eagle draft"):
        d.distill(str(target), str(tmp_path / "a"), init=str(out), **small)  # kind eagle
    with pytest.raises(ModelError, match=r"target.config\.json: not an EAGLE-3 draft"):
        d.distill(str(target), str(tmp_path / "b"), kind="eagle3", init=str(target), **small)
    mlp = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    with pytest.raises(OptionError, match=f"MLP of {mlp['intermediate_size']}.*mlp=7"):
        d.distill(str(target), str(tmp_path / "c"), kind="eagle3", init=str(out), mlp=7, **small)
    with pytest.raises(OptionError, match="1 decoder layers.*layers=2"):
        d.distill(str(target), str(tmp_path / "e"), kind="eagle3", init=str(out), layers=2, **small)
    written = {p.name for p in tmp_path.iterdir()}
    assert not written & {
        "a",
        "b",
        "c",
        "e",
        ".distill-a",
        ".distill-b",
        ".distill-c",
        ".distill-e",
    }


def test_a_resumed_run_with_another_init_vocabulary_is_refused(run, tmp_path):
    """The checkpoint's head stands for the ids it was trained over: a resume whose --init draft
    proposes others is refused by name, before vocab.json is overwritten."""
    target, _, out = run
    small = {**RUN, "epochs": 1, "max_new": 24, "tokens": 400}
    first = d.distill(str(target), str(tmp_path / "more"), kind="eagle3", init=str(out), **small)
    vocab = tmp_path / ".distill-more" / "checkpoints" / "vocab.json"
    other = [i + 1 for i in json.loads(vocab.read_text())]  # what another draft's head covers
    vocab.write_text(json.dumps(other))
    with pytest.raises(ModelError, match=r"vocab\.json: the checkpoint's head was trained over"):
        d.distill(
            str(target), str(first), kind="eagle3", init=str(out), resume=True, force=True, **small
        )
    assert json.loads(vocab.read_text()) == other


def test_a_corpus_read_past_its_tokens_shows_no_negative_wait(capsys):
    # A corpus shard ends where its files' pieces end, so the data may pass --tokens.
    from macspec.tools.distill.data import data_bar

    data_bar(6_200, 6_200, 6_000, start=0.0)
    line = capsys.readouterr().err
    assert "100.0%" in line and "ETA 0:00" in line, line
