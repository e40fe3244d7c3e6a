"""`macspec distill` on a tiny target: a loadable, compatible draft that beats its untrained self,
reproducible resume, and clear errors for bad inputs."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from support.tinymodels import make_tiny_model
from support.unrolled import assert_unrolled_steps_attend_as_drafting_does

import macspec
from macspec.base.errors import MacspecError, ModelError, OptionError, PromptError
from macspec.cli import main
from macspec.core.drafters.eagle import EagleDraft, TargetParts, draft_config
from macspec.models.compat import check
from macspec.models.draft_files import read_draft, save_draft
from macspec.models.store import _acceptance
from macspec.tools import distill as d
from macspec.tools.distill.data import (
    TEMPERATURE_CYCLES,
    Dataset,
    data_jobs,
    feature_taps,
    generate_data,
    parse_feature_layers,
    training_prompts,
)
from macspec.tools.distill.evaluation import headline
from macspec.tools.distill.training import deepen_draft, train, widen_draft

SMALL_RUN = {"tokens": 2000, "max_new": 16, "epochs": 10, "eval_tokens": 8, "progress": False}
# For drafts whose quality no assertion reads (a refusal, a shape): the least a run writes.
TINY_RUN = {"tokens": 200, "max_new": 8, "epochs": 1, "eval_tokens": 4, "progress": False}
# Deepening a trained draft: the new layer needs little data to keep drafts accepted.
DEEP_RUN = {**SMALL_RUN, "tokens": 500, "epochs": 3}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    target = make_tiny_model(root / "target", seed=0, hidden=48, tie=False, scale=2.0, context=512)
    out = d.distill(str(target), str(root / "draft"), vocab=40, lr=1e-2, seed=0, **SMALL_RUN)
    return target, out


def test_distilled_draft_loads_and_passes_the_check(run):
    target, out = run
    for name in ("draft.json", "config.json", "model.safetensors", "tokenizer.json", "report.json"):
        assert (out / name).is_file(), name
    assert check(target, out).compatible
    pair = macspec.load(target, out)
    assert pair.drafter_kind == "eagle+ngram"
    plain = macspec.generate(pair, "Once upon a time", max_tokens=30, speculative=False)
    spec = macspec.generate(pair, "Once upon a time", max_tokens=30, num_draft=4)
    assert spec.tokens == plain.tokens and spec.stats.drafted > 0
    _, vocab_ids, meta = read_draft(out)
    assert meta["kind"] == "eagle" and vocab_ids.size == 40


def test_report_has_the_evaluation(run):
    report = json.loads((run[1] / "report.json").read_text())
    for t in ("temperature_0", "temperature_0.7"):
        chat = report["evaluation"][t]["chat"]
        assert 0.0 <= chat["acceptance_rate"] <= 1.0
        assert 1.0 <= chat["mean_accepted_length"] <= 5.0
        by_position = chat["acceptance_by_position"]  # pooled over the answers, K=4
        assert 1 <= len(by_position) <= 4 and all(0.0 <= a <= 1.0 for a in by_position)
    speed = report["evaluation"]["speed_chat_temperature_0"]
    assert speed["plain"]["tokens_per_second"] > 0 and "speedup" in speed["adaptive_k"]
    assert 0.0 < report["vocab"]["coverage"] <= 1.0
    assert (
        report["summary"]["acceptance_rate_t0"]
        == report["evaluation"]["temperature_0"]["chat"]["acceptance_rate"]
    )
    chat_t0 = report["summary"]["acceptance_rate_t0"]
    assert _acceptance(report).startswith(f"chat K=4: {chat_t0:.1%} at T=0, ")  # `macspec models`
    chat = report["evaluation"]["temperature_0"]["chat"]
    line = headline(report)  # what distill says at its end
    assert f"chat {chat['acceptance_rate']:.1%} (" in line
    assert f"{chat['acceptance_by_position'][0]:.0%}" in line and "x plain" in line
    before, after = report["agreement_top1_by_position"].values()
    assert after[0] > before[0] + 0.2


def acceptance(pair, prompts):
    drafted = accepted = 0
    for i, prompt in enumerate(prompts):
        r = macspec.generate(pair, prompt, max_tokens=24, seed=i, adaptive=False)
        drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
    return accepted / drafted


def test_training_raises_acceptance(run, tmp_path):
    target, out = run
    trained = macspec.load(target, out)
    # The same draft before training: the seeded initial weights, the same vocabulary.
    draft, vocab_ids, meta = read_draft(out)
    mx.random.seed(meta["seed"])
    initial = EagleDraft(meta["config"])
    initial.init_from_features(draft.feature_mean, draft.feature_std)
    untrained = tmp_path / "untrained"
    save_draft(untrained, initial, vocab_ids.tolist(), meta["config"])
    (untrained / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes())
    before = macspec.load(target, untrained)
    prompts = training_prompts(trained)[:12:3]
    assert acceptance(trained, prompts) > acceptance(before, prompts) + 0.1


def _interrupt_at(monkeypatch, call: int) -> None:
    """Training stops (KeyboardInterrupt) when it asks for its `call`-th batch."""
    real_batch, calls = Dataset.batch, []

    def interrupted(self, rows):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real_batch(self, rows)

    monkeypatch.setattr(Dataset, "batch", interrupted)


def test_resume_repeats_the_same_steps(run, monkeypatch, tmp_path):
    target, out = run
    data = Dataset(out.parent / f".distill-{out.name}" / "data", SMALL_RUN["max_new"])
    pair = macspec.load(target)
    parts = TargetParts(pair.target, mx.arange(pair.vocab_size))
    config = draft_config(pair.target)
    kw = {"epochs": 2, "batch_rows": 8, "lr": 3e-3, "seed": 5, "progress": False}

    mx.random.seed(0)
    whole = EagleDraft(config)
    train(whole, parts, data, tmp_path / "a", **kw)

    mx.random.seed(0)
    part = EagleDraft(config)
    _interrupt_at(monkeypatch, 7)
    with pytest.raises(KeyboardInterrupt):
        train(part, parts, data, tmp_path / "b", checkpoint_every=2, **kw)
    monkeypatch.undo()
    assert json.loads((tmp_path / "b" / "checkpoint.json").read_text())["step"] == 6
    mx.random.seed(1)
    resumed = EagleDraft(config)  # other initial weights: the checkpoint must replace them
    train(resumed, parts, data, tmp_path / "b", resume=True, checkpoint_every=2, **kw)
    for (name, a), (_, b) in zip(
        tree_flatten(whole.parameters()), tree_flatten(resumed.parameters()), strict=True
    ):
        assert np.allclose(np.array(a), np.array(b), atol=1e-5), name


def test_checkpoints_come_by_time_too(run, monkeypatch, tmp_path):
    target, out = run
    data = Dataset(out.parent / f".distill-{out.name}" / "data", SMALL_RUN["max_new"])
    pair = macspec.load(target)
    parts = TargetParts(pair.target, mx.arange(pair.vocab_size))
    _interrupt_at(monkeypatch, 4)
    kw = {"epochs": 2, "batch_rows": 8, "lr": 3e-3, "seed": 5, "progress": False}
    with pytest.raises(KeyboardInterrupt):  # no step count reached, every second due
        train(
            EagleDraft(draft_config(pair.target)),
            parts,
            data,
            tmp_path / "c",
            checkpoint_every=1000,
            checkpoint_seconds=0.0,
            **kw,
        )
    assert json.loads((tmp_path / "c" / "checkpoint.json").read_text())["step"] == 3


def test_split_holds_one_group_out_when_the_bucket_is_empty(run):
    target, out = run
    data = Dataset(out.parent / f".distill-{out.name}" / "data", SMALL_RUN["max_new"])
    groups = sorted(set(data.prompt))
    data.prompt = [groups[r % 3] * 20 for r in range(len(data))]  # no group in bucket 19
    train_rows, held = data.split()
    assert held and train_rows and sorted(train_rows + held) == list(range(len(data)))
    assert len({data.prompt[r] for r in held}) == 1
    data.prompt = [groups[0]] * len(data)  # one group: nothing to hold out
    assert data.split() == (list(range(len(data))), [])


def test_resumed_distill_reuses_data_and_checkpoint(run):
    target, out = run
    shards = sorted((out.parent / f".distill-{out.name}" / "data").glob("shard-*"))
    stamps = [s.stat().st_mtime_ns for s in shards]
    weights = mx.load(str(out / "model.safetensors"))
    again = d.distill(
        str(target), str(out), vocab=40, lr=1e-2, seed=0, resume=True, force=True, **SMALL_RUN
    )
    assert [s.stat().st_mtime_ns for s in shards] == stamps
    for name, value in mx.load(str(again / "model.safetensors")).items():
        assert mx.array_equal(value, weights[name]).item(), name


def test_init_continues_training_a_draft(run, tmp_path):
    target, out = run
    more = d.distill(
        str(target), str(tmp_path / "more"), init=str(out), lr=3e-3, seed=1, **SMALL_RUN
    )
    _, first_vocab, _ = read_draft(out)
    _, vocab, _ = read_draft(more)
    assert vocab.tolist() == first_vocab.tolist()  # its own 40 ids, not the default --vocab
    first = json.loads((out / "report.json").read_text())["agreement_top1_by_position"]
    report = json.loads((more / "report.json").read_text())
    assert Path(report["init"]) == out.resolve()
    # It starts where the first run ended (other data, same prompts), not from random weights.
    assert report["agreement_top1_by_position"]["before"][0] > first["before"][0] + 0.2
    pair = macspec.load(target, more)
    plain = macspec.generate(pair, "Once upon a time", max_tokens=30, speculative=False)
    assert macspec.generate(pair, "Once upon a time", max_tokens=30).tokens == plain.tokens


def test_init_must_be_an_eagle_draft_for_this_target(run, tmp_path):
    target, _ = run
    with pytest.raises(ModelError, match="cannot read the eagle draft"):
        d.distill(str(target), str(tmp_path / "a"), init=str(target), **SMALL_RUN)
    other = make_tiny_model(tmp_path / "wide", seed=0, hidden=64, tie=False, context=512)
    wide = d.distill(str(other), str(tmp_path / "wide-draft"), vocab=40, **TINY_RUN)
    with pytest.raises(ModelError, match="hidden size 64"):
        d.distill(str(target), str(tmp_path / "b"), init=str(wide), **SMALL_RUN)
    written = {p.name for p in tmp_path.iterdir()}
    assert not written & {"a", "b", ".distill-a", ".distill-b"}  # refused before writing


def test_held_out_prompts_do_not_depend_on_the_seed(run, tmp_path):
    pair = macspec.load(run[0])
    prompts = training_prompts(pair)[:60]
    status = []  # prompt ids -> held out?
    for seed in (0, 1):
        generate_data(
            pair,
            prompts,
            tmp_path / str(seed),
            tokens=600,
            seed=seed,
            rows=8,
            max_new=4,
            progress=False,
        )
        data = Dataset(tmp_path / str(seed), 4)
        held = set(data.split()[1])
        status.append(
            {data.ids[r][: data.first[r] + 2].tobytes(): r in held for r in range(len(data))}
        )
    both = status[0].keys() & status[1].keys()  # prompts met in both runs, in another order
    assert any(status[0][p] for p in both) and not all(status[0][p] for p in both)
    assert all(status[0][p] == status[1][p] for p in both)


def test_sampled_data_is_seeded(tmp_path, run):
    pair = macspec.load(run[0])
    prompts = training_prompts(pair)[:3]
    for name in ("a", "b"):
        generate_data(
            pair, prompts, tmp_path / name, tokens=60, seed=3, rows=4, max_new=8, progress=False
        )
    a, b = (mx.load(str(tmp_path / n / "shard-00000.safetensors")) for n in ("a", "b"))
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    written = len(list((tmp_path / "a").glob("shard-*")))
    assert written >= 2
    # A smaller budget later reuses the first shards only, and training reads only those.
    have, shards = generate_data(
        pair, prompts, tmp_path / "a", tokens=1, seed=3, rows=4, max_new=8, progress=False
    )
    assert shards == 1 and len(Dataset(tmp_path / "a", 8, shards)) == 4
    assert len(list((tmp_path / "a").glob("shard-*"))) == written
    # Every stored hidden state is the target's own at that position (left padding is exact).
    row = 1
    s, e = a["starts"][row].item(), a["ends"][row].item()
    ids = a["tokens"][row, s:e]
    h = pair.target.model(ids[None])[0]
    assert mx.allclose(h, a["hidden"][row, s:e].astype(mx.float32), atol=2e-2).item()


def test_bad_inputs_give_clear_errors(run, tmp_path, capsys):
    target, _ = run
    with pytest.raises(ModelError):
        d.distill(str(tmp_path / "missing"), str(tmp_path / "o1"), **SMALL_RUN)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(PromptError, match="no prompts"):
        d.distill(str(target), str(tmp_path / "o2"), prompts=str(empty), **SMALL_RUN)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OptionError, match="cannot write"):
        d.distill(str(target), str(blocker / "draft"), **SMALL_RUN)
    with pytest.raises(OptionError, match="choose eagle or eagle3"):
        d.distill(str(target), str(tmp_path / "o3"), kind="small", **SMALL_RUN)
    with pytest.raises(OptionError, match="tokens"):
        d.distill(str(target), str(tmp_path / "o4"), tokens=0)
    (tmp_path / "o5").mkdir()
    with pytest.raises(OptionError, match="already exists"):
        d.distill(str(target), str(tmp_path / "o5"), **SMALL_RUN)
    code = main(["distill", str(tmp_path / "missing"), "-o", str(tmp_path / "o6")])
    assert code == 1
    assert "macspec: error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    "feature_layers,layers",
    [((), 1), ((0,), 1), ((), 2)],
    ids=["final features", "tapped layer", "two layers"],
)
def test_unrolled_training_steps_attend_as_drafting_does(tmp_path, feature_layers, layers):
    """Training's unrolled steps (EAGLE-3's training-time test) equal what the drafter computes
    with its cache: step s at position t = the s-th draft token after anchor t - s, attending to
    the real positions up to the anchor and to its own earlier drafted positions only."""

    target = macspec.load(make_tiny_model(tmp_path / "t", seed=0, hidden=48, layers=2)).target
    mx.random.seed(3)
    draft = EagleDraft(draft_config(target, feature_layers, layers))
    assert_unrolled_steps_attend_as_drafting_does(draft, target, feature_layers, layers)


def test_shards_keep_the_tapped_layer_outputs(tmp_path, run):
    """With taps, each shard row holds the target's own layer outputs at every position (left
    padding is exact there too), and Dataset joins them before the final features."""
    from macspec.core.target import hidden_states

    pair = macspec.load(run[0])
    taps = feature_taps(len(pair.target.model.layers))
    assert taps == (0,)  # 2 layers: the last one's output is the final features before the norm
    prompts = training_prompts(pair)[:3]
    generate_data(
        pair, prompts, tmp_path, tokens=30, seed=3, rows=4, max_new=8, taps=taps, progress=False
    )
    shard = mx.load(str(tmp_path / "shard-00000.safetensors"))
    row = 2
    s, e = shard["starts"][row].item(), shard["ends"][row].item()
    want = hidden_states(pair.target, shard["tokens"][row, s:e], None, taps)
    got = mx.concatenate([shard["layers"][row, s:e, 0], shard["hidden"][row, s:e]], axis=-1)
    assert mx.allclose(want, got.astype(mx.float32), atol=2e-2).item()
    data = Dataset(tmp_path, 8, layers=True)
    assert data.feats[0].shape[1] == 2 * data.hidden_size
    untapped = tmp_path / "untapped"
    generate_data(pair, prompts, untapped, tokens=10, seed=3, rows=4, max_new=8, progress=False)
    with pytest.raises(MacspecError, match="no layer outputs"):
        Dataset(untapped, 8, layers=True)


def test_a_partial_data_cycle_covers_prompts_of_every_length():
    """Batches group similar lengths only within windows, so the first shards of a run that
    stops early are not all short prompts."""
    rng = np.random.default_rng(0)
    prompts = [[1] * int(n) for n in rng.integers(5, 300, size=2000)]
    jobs = data_jobs(prompts, seed=0, rows=32)
    first = [len(prompts[i]) for job in jobs[:10] for i, _ in job]
    assert max(first) > 250 and min(first) < 20
    cycle = [i for job in jobs for i, t in job if t == TEMPERATURE_CYCLES[0][0]]
    assert sorted(cycle)[:2000] == list(range(2000))  # every prompt in the first cycle


def test_widened_draft_predicts_what_it_did(tmp_path):
    """widen_draft: a final-features draft given tapped layers starts out exactly as it was."""
    from macspec.core.target import hidden_states

    target = macspec.load(make_tiny_model(tmp_path / "t", seed=0, hidden=48, layers=3)).target
    mx.random.seed(5)
    narrow = EagleDraft(draft_config(target))
    narrow.init_from_features(mx.random.normal((48,)), 1.0 + mx.random.uniform(shape=(48,)))
    config = draft_config(target, (0, 1))
    stats = (mx.random.normal((3 * 48,)), 1.0 + mx.random.uniform(shape=(3 * 48,)))
    wide = widen_draft(narrow, config, stats)
    assert wide.feature_layers == (0, 1)
    ids = mx.array([1, 9, 4, 7, 12, 3])
    feats = hidden_states(target, ids[:-1], None, (0, 1))[None]
    embeds = target.model.embed_tokens(ids[1:])[None]
    want = narrow(feats[..., -48:], embeds)
    assert mx.allclose(wide(feats, embeds), want, atol=1e-4).item()
    assert mx.array_equal(wide.feature_mean[:96], stats[0][:96]).item()


def test_deepened_draft_predicts_what_it_did(tmp_path):
    """deepen_draft: the added layers start as the identity, so the draft predicts exactly what
    it did; training then moves them (their output projections are trainable)."""
    target = macspec.load(make_tiny_model(tmp_path / "t", seed=0, hidden=48, layers=2)).target
    mx.random.seed(6)
    shallow = EagleDraft(draft_config(target))
    shallow.init_from_features(mx.random.normal((48,)), 1.0 + mx.random.uniform(shape=(48,)))
    deep = deepen_draft(shallow, draft_config(target, (), 3))
    assert len(deep.blocks) == 3
    feats, embeds = mx.random.normal((1, 7, 48)), target.model.embed_tokens(mx.arange(1, 8))[None]
    assert mx.array_equal(deep(feats, embeds), shallow(feats, embeds)).item()
    names = dict(tree_flatten(deep.trainable_parameters()))
    assert "more.1.mlp.down_proj.weight" in names and "more.0.self_attn.o_proj.weight" in names


def test_layers_deepens_an_init_draft_and_never_drops_layers(run, tmp_path):
    target, out = run
    deep = d.distill(
        str(target), str(tmp_path / "deep"), init=str(out), layers=2, lr=3e-3, seed=1, **DEEP_RUN
    )
    draft, _, meta = read_draft(deep)
    assert meta["config"]["layers"] == 2 and len(draft.blocks) == 2
    assert Path(json.loads((deep / "report.json").read_text())["init"]) == out.resolve()
    pair = macspec.load(target, deep)
    plain = macspec.generate(pair, "Once upon a time", max_tokens=30, speculative=False)
    spec = macspec.generate(pair, "Once upon a time", max_tokens=30, num_draft=3)
    assert spec.tokens == plain.tokens and spec.stats.accepted > 0
    with pytest.raises(OptionError, match="has 2 decoder layers"):
        d.distill(str(target), str(tmp_path / "shallow"), init=str(deep), layers=1, **SMALL_RUN)
    with pytest.raises(OptionError, match="invalid layers=0"):
        d.distill(str(target), str(tmp_path / "none"), layers=0, **SMALL_RUN)
    assert not (tmp_path / "shallow").exists() and not (tmp_path / ".distill-shallow").exists()


@pytest.mark.parametrize("value", ["", "x", "2,x", "-1", "29", "30"])
def test_bad_feature_layers_are_refused_by_name(value):
    with pytest.raises(OptionError, match=f"invalid feature_layers={value!r}"):
        parse_feature_layers(value, 30)


def test_feature_layers_values():
    assert parse_feature_layers("auto", 30) == (2, 15, 27)
    assert parse_feature_layers("none", 30) == ()
    assert parse_feature_layers("27,2,2", 30) == (2, 27)
    assert feature_taps(1) == () and feature_taps(4) == (1, 2)


def test_the_target_writes_its_own_training_prompts(tmp_path):
    from macspec.tools.distill.self_prompts import open_user_turn, self_prompts

    # A few characters, so the random target ends its messages and writes words.
    target = make_tiny_model(tmp_path / "t", seed=0, hidden=48, chars="ab ", scale=0.3, context=512)
    pair = macspec.load(target)
    turn = open_user_turn(pair)
    asked = macspec.api.stream.prompt_ids(pair, messages=[{"role": "user", "content": "ab ba"}])
    assert asked[: len(turn)] == turn and len(asked) > len(turn)
    texts = self_prompts(pair, 6, tmp_path / "a", seed=1, rows=16, max_new=24, progress=False)
    assert len(texts) == 6 and len({" ".join(t.split()) for t in texts}) == 6
    assert all(3 <= len(t.split()) <= 80 and set(t) <= set("ab \n") for t in texts)
    # Seeded, and a resumed run keeps the prompts it has and adds new ones.
    again = self_prompts(pair, 6, tmp_path / "b", seed=1, rows=16, max_new=24, progress=False)
    assert again == texts
    more = self_prompts(pair, 9, tmp_path / "a", seed=1, rows=16, max_new=24, progress=False)
    assert more[:6] == texts and len(set(more)) == 9
    assert self_prompts(pair, 4, tmp_path / "a", seed=1, progress=False) == texts[:4]
    other = self_prompts(pair, 6, tmp_path / "c", seed=2, rows=16, max_new=24, progress=False)
    assert other != texts


def test_self_written_prompts_skip_the_benchmark_topics_and_repeats():
    from macspec.tools.distill.self_prompts import keep

    seen = {"how do i cook rice?"}
    assert keep("How can I plan a trip to Rome?", seen)
    assert not keep("How do I   cook rice?", seen)  # a repeat, up to spaces and case
    assert not keep("Why is the sky blue at noon?", seen)  # a benchmark topic
    assert not keep("How to SLEEP well", seen)
    assert not keep("Hello there", seen)  # too short


def test_self_prompts_feed_the_data_and_lock_a_resumed_run(tmp_path):
    target = make_tiny_model(tmp_path / "t", seed=0, hidden=48, chars="ab ", scale=0.3, context=512)
    small = {**SMALL_RUN, "tokens": 200, "epochs": 1}
    out = d.distill(str(target), str(tmp_path / "draft"), vocab=4, self_prompts=5, **small)
    work = tmp_path / ".distill-draft"
    assert len(json.loads((work / "self-prompts.json").read_text())) == 5
    assert json.loads((work / "run.json").read_text())["self_prompts"] == 5
    assert json.loads((out / "report.json").read_text())["data"]["self_prompts"] == 5
    with pytest.raises(ModelError, match="self_prompts=5"):
        d.distill(str(target), str(tmp_path / "draft"), force=True, resume=True, **small)
    with pytest.raises(OptionError, match="self_prompts"):
        d.distill(str(target), str(tmp_path / "x"), self_prompts=-1, **small)


def test_rows_that_end_leave_the_batch_and_the_rest_sample_as_alone(tmp_path):
    """sample_rows drops a row from the batch after its EOS: every row's continuation, states
    and end are what it gets sampled alone, and nothing is kept past its end."""
    from macspec.tools.distill.data import sample_rows

    target = make_tiny_model(tmp_path / "t", seed=1, layers=4)
    model = macspec.load(str(target)).target
    prompts = [[3, 9, 4], [5, 6, 7, 8, 9, 10], [11, 4], [7, 7, 7, 2, 3]]
    free = sample_rows(model, prompts, [0.0] * 4, 12, mx.random.key(0), set(), taps=(1,))[0]
    # The ids rows 1 and 2 first write at a later step: they end there (others where they
    # write them), at two different steps.
    eos = set()
    for row in (free[1, 6:].tolist(), free[2, 6:].tolist()):
        eos.add(next(row[k] for k in range(2, 12) if row[k] not in row[:k]))
    toks, hid, starts, ends, layers = sample_rows(
        model, prompts, [0.0] * 4, 12, mx.random.key(0), eos, taps=(1,)
    )
    assert len(set(ends.tolist()) - {6 + 12}) == 2, ends
    for r, p in enumerate(prompts):
        alone = sample_rows(model, [p], [0.0], 12, mx.random.key(0), eos, taps=(1,))
        e, s, w = int(ends[r]), int(starts[r]), len(p)
        assert alone[3][0] - w == e - 6  # the same end, counted from its prompt's end
        assert toks[r, s:e].tolist() == alone[0][0, : alone[3][0]].tolist()
        np.testing.assert_allclose(hid[r, s:e], alone[1][0, : alone[3][0]], atol=2e-3)
        np.testing.assert_allclose(layers[r, s:e], alone[4][0, : alone[3][0]], atol=2e-3)
        assert not toks[r, e:].any() and not hid[r, e:].any() and not layers[r, e:].any()


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next"])
def test_a_target_whose_rows_cannot_be_batched_is_refused_before_sampling(arch, tmp_path):
    """A sliding-window or recurrent layer's cache takes no per-row padding mask: sampled data
    is refused by name (--corpus reads one sequence at a time), with nothing written."""
    from support import archzoo

    target = archzoo.make_arch_model(tmp_path / "t", arch, seed=3)
    with pytest.raises(ModelError, match=r"this target has \w+ layers.*--corpus"):
        d.distill(str(target), str(tmp_path / "draft"), **TINY_RUN)
    assert not (tmp_path / "draft").exists() and not (tmp_path / ".distill-draft").exists()
