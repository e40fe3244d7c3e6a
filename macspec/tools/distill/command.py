"""`distill()` and the `macspec distill` command: the stages in order, in one work directory."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ...api.pair import load
from ...base.errors import ModelError, OptionError, PromptError
from ...core.drafters.eagle import TargetParts, draft_config
from ...models.draft_files import load_draft, save_draft
from ...models.eagle3_draft import load_draft as load_eagle3
from ...models.eagle3_export import export
from ...models.store import _looks_like_path, store_root, validate_name
from .config import DistillConfig, add_arguments
from .corpus import Row, corpus_data, corpus_rows
from .data import (
    DATA_ROWS,
    Dataset,
    batch_cache,
    chat_ids,
    choose_vocab,
    generate_data,
    parse_feature_layers,
    training_prompts,
)
from .eagle3_kind import FORMAT, eagle3_config, eagle3_taps, feature_scale, new_draft, read_init
from .evaluation import agreement, draft_report, headline
from .progress import say
from .self_prompts import self_prompts
from .training import init_draft, keep_vocab, kept_vocab, start_draft, train

# The settings a resumed run must share with the one that made its data and checkpoints
# (run.json); tokens and epochs may grow.
_LOCKED = (
    "target",
    "seed",
    "max_new",
    "rows",
    "prompts",
    "self_prompts",
    "corpus",
    "feature_layers",
    "kind",
    "layers",
    "mlp",
    "vocab",
    "unroll",
)
# What a run.json written before a setting existed meant by its absence.
_ABSENT = {"feature_layers": [], "self_prompts": 0, "corpus": None, "kind": "eagle", "mlp": None}


@dataclass(frozen=True)
class _Run:
    """What the stages of one run share."""

    config: DistillConfig
    pair: Any
    out: Path
    work: Path
    taps: tuple[int, ...]
    layers: int
    prompts: list[list[int]]
    rows: list[Row]  # --corpus: the pieces of text the target reads (else empty)
    start_from: tuple[Any, list[int], Path] | None
    progress: bool


def distill(
    target: str,
    output: str,
    config: DistillConfig | None = None,
    *,
    progress: bool = True,
    **options: Any,
) -> Path:
    """Train a draft for `target` and write it to `output` (a store name or a directory).

    `config` and `options` (DistillConfig's fields: tokens=..., resume=True, init=...) set the
    run. Work files (sampled data, checkpoints) go to a hidden `.distill-<name>` directory beside
    the output, so an interrupted run continues with resume=True. Returns the draft's directory."""
    run = _prepare(target, output, DistillConfig.of(config, **options), progress)
    data, data_seconds = _sample(run)
    shape = draft_config(run.pair.target, run.taps, run.layers)
    if run.config.mlp is not None:
        shape["intermediate_size"] = run.config.mlp
    draft, vocab_ids, facts = _train(run, data, shape)
    staged = _stage(run, draft, vocab_ids, shape)
    say("evaluating on the built-in prompts (held out from training)")
    report = draft_report(
        run.pair,
        draft,
        data,
        vocab_ids,
        facts={
            **facts,
            "data": {
                "prompts": len(run.prompts),
                "self_prompts": run.config.self_prompts,
                "seconds": round(data_seconds, 1),
            },
        },
        eval_tokens=run.config.eval_tokens,
        seed=run.config.seed,
        progress=progress,
    )
    (staged / "report.json").write_text(json.dumps(report, indent=1))
    if run.out.exists():
        shutil.rmtree(run.out)
    shutil.copytree(staged, run.out)
    say(f"wrote {run.out}")
    say(headline(report))
    return run.out


def _prepare(target: str, output: str, cfg: DistillConfig, progress: bool) -> _Run:
    """Every check that can fail, before the long part: the output, the work directory, the
    target, the draft to continue, the feature layers, the prompts. Then run.json."""
    out = _output_dir(output)
    work = out.parent / f".distill-{out.name}"
    if out.exists() and not cfg.force:
        raise OptionError(f"{out} already exists; pass --force to replace it")
    if work.exists() and not cfg.resume:
        raise OptionError(
            f"an earlier distill run left {work}: pass --resume to continue it, or delete it"
        )
    pair = load(target)  # raises ModelError for a missing target
    start_from = None
    if cfg.init is not None:
        start_from = (read_init if cfg.kind == "eagle3" else init_draft)(cfg.init, pair)
    taps = _taps(cfg.feature_layers, pair, start_from, cfg.kind)
    layers = _layers(cfg.layers, start_from)
    if cfg.kind == "eagle3" and start_from is not None:
        _same_shape(cfg, layers, start_from)
    if cfg.corpus is not None:  # raises ModelError for a missing or empty corpus
        rows = corpus_rows(pair, cfg.corpus, cfg.tokens, cfg.max_new, cfg.seed)
        fits: list[list[int]] = []
        rows = [r for r in rows if len(r.prompt) + len(r.text) < pair.context_length]
        if not rows:
            raise PromptError(f"no corpus piece fits the target's context of {pair.context_length}")
    else:
        batch_cache(pair.target)  # ModelError for a target whose rows cannot be batched
        ids = training_prompts(pair, cfg.prompts)  # raises PromptError for a bad prompt file
        fits, rows = _fitting(ids, cfg, pair), []
        if not fits:
            raise PromptError(
                f"no training prompt fits the target's context of {pair.context_length}"
            )
    _writable(work)
    run = _Run(cfg, pair, out, work, taps, layers, fits, rows, start_from, progress)
    _record(run)
    return run


def _fitting(ids: list[list[int]], cfg: DistillConfig, pair: Any) -> list[list[int]]:
    """The prompts that leave room in the target's context for a whole continuation."""
    return [p for p in ids if len(p) + cfg.max_new < pair.context_length]


def _taps(
    feature_layers: str | None, pair: Any, start_from: tuple | None, kind: str
) -> tuple[int, ...]:
    """The target layers the draft reads: the option's, else "auto", or the --init draft's."""
    if feature_layers is None:
        feature_layers = "auto" if start_from is None else "init"
    if feature_layers == "init":
        return tuple(start_from[0].feature_layers)
    if feature_layers == "auto" and kind == "eagle3":
        return eagle3_taps(len(pair.target.model.layers))
    taps = parse_feature_layers(feature_layers, len(pair.target.model.layers))
    if start_from is not None and start_from[0].feature_layers not in ((), taps):
        raise OptionError(
            f"the draft {start_from[2]} reads target layers {list(start_from[0].feature_layers)}:"
            f" continue it with those, not feature_layers={feature_layers!r}"
        )
    return taps


def _same_shape(cfg: DistillConfig, layers: int, start_from: tuple) -> None:
    """An EAGLE-3 draft is continued as it is: --mlp and --layers may only repeat its own."""
    draft, _, path = start_from
    mlp = draft.config.intermediate_size
    if cfg.mlp is not None and cfg.mlp != mlp:
        raise OptionError(
            f"the draft {path} has an MLP of {mlp}: continue it with that, not mlp={cfg.mlp}"
        )
    if layers != draft.config.num_layers:
        raise OptionError(
            f"the EAGLE-3 draft {path} has {draft.config.num_layers} decoder layers: distill "
            f"continues it with those, not layers={layers}"
        )


def _layers(layers: int | None, start_from: tuple | None) -> int:
    """The draft's decoder layers: the option's, else 1 or the --init draft's (never fewer)."""
    had = 1 if start_from is None else len(start_from[0].blocks)
    if layers is not None and layers < had:
        raise OptionError(
            f"the draft {start_from[2]} has {had} decoder layers: continue it with {had} or "
            f"more, not layers={layers}"
        )
    return had if layers is None else layers


def _record(run: _Run) -> None:
    """Write run.json, refusing a work directory whose data was made with other settings."""
    cfg = run.config
    settings = {
        "target": str(run.pair.target_path),
        "seed": cfg.seed,
        "max_new": cfg.max_new,
        "rows": DATA_ROWS,
        "prompts": len(run.prompts),
        "self_prompts": cfg.self_prompts,
        "corpus": None if cfg.corpus is None else str(Path(cfg.corpus).expanduser().resolve()),
        "feature_layers": list(run.taps),
        "kind": cfg.kind,
        "layers": run.layers,
        "mlp": cfg.mlp,
        "vocab": cfg.vocab,
        "unroll": cfg.unroll,
        "epochs": cfg.epochs,
        "batch_rows": cfg.batch_rows,
        "lr": cfg.learning_rate,
        "tokens": cfg.tokens,
        "init": _init_name(run),
    }
    run_file = run.work / "run.json"
    if run_file.is_file():
        before = json.loads(run_file.read_text())
        changed = [k for k in _LOCKED if before.get(k, _ABSENT.get(k)) != settings[k]]
        if changed:
            was = ", ".join(f"{k}={before.get(k, _ABSENT.get(k))!r}" for k in changed)
            raise ModelError(
                f"{run_file} was made with other settings ({was}); resume with those, or "
                "delete the directory to restart"
            )
    run_file.write_text(json.dumps(settings, indent=1))


def _sample(run: _Run) -> tuple[Dataset, float]:
    """Sample the data (keeping the shards an earlier run made); returns it and the seconds."""
    cfg = run.config
    start = time.perf_counter()
    prompts = run.prompts
    if cfg.self_prompts:
        say(f"the target writes {cfg.self_prompts} training prompts itself")
        texts = self_prompts(
            run.pair, cfg.self_prompts, run.work, seed=cfg.seed, progress=run.progress
        )
        prompts = prompts + _fitting(chat_ids(run.pair, texts), cfg, run.pair)
    if run.rows:
        say(f"{run.pair.target_path.name} reads {cfg.tokens} ids of {cfg.corpus}")
        _, shards = corpus_data(
            run.pair,
            run.rows,
            run.work / "data",
            tokens=cfg.tokens,
            taps=run.taps,
            progress=run.progress,
        )
        seconds = time.perf_counter() - start
        return Dataset(run.work / "data", cfg.max_new, shards, layers=bool(run.taps)), seconds
    say(f"sampling {cfg.tokens} tokens from {run.pair.target_path.name} into {run.work / 'data'}")
    _, shards = generate_data(
        run.pair,
        prompts,
        run.work / "data",
        tokens=cfg.tokens,
        seed=cfg.seed,
        rows=DATA_ROWS,
        max_new=cfg.max_new,
        taps=run.taps,
        progress=run.progress,
    )
    seconds = time.perf_counter() - start
    return Dataset(run.work / "data", cfg.max_new, shards, layers=bool(run.taps)), seconds


def _init_name(run: _Run) -> str | None:
    return None if run.start_from is None else str(run.start_from[2])


def _train(run: _Run, data: Dataset, shape: dict) -> tuple[Any, list[int], dict]:
    """Train a draft of `shape` (draft_config) on the data; returns it, its vocabulary and the
    facts for the report."""
    cfg, pair = run.config, run.pair
    train_rows, held = data.split()
    mx.random.seed(cfg.seed)
    ckpt_dir = run.work / "checkpoints"
    kept = kept_vocab(ckpt_dir) if cfg.resume else None
    if cfg.kind == "eagle3" and run.start_from is not None:
        # The published draft goes on, reading the features over this data's scale.
        draft, vocab_ids = run.start_from[0].with_scale(feature_scale(data)), run.start_from[1]
        parts = TargetParts(pair.target, mx.array(vocab_ids, dtype=mx.int32))
    elif cfg.kind == "eagle3":
        vocab_ids = kept or choose_vocab(data, cfg.vocab, set(pair.eos_token_ids), pair.vocab_size)
        parts = TargetParts(pair.target, mx.array(vocab_ids, dtype=mx.int32))
        config = eagle3_config(pair, run.taps, run.layers, cfg.mlp, vocab_ids)
        draft = new_draft(config, run.taps, data, parts.head)
    else:
        draft, vocab_ids = start_draft(data, shape, cfg.vocab, pair, run.start_from, kept)
        parts = TargetParts(pair.target, mx.array(vocab_ids, dtype=mx.int32))
    if kept is not None and kept != vocab_ids:  # an --init draft's ids, another than before
        raise ModelError(
            f"{ckpt_dir / 'vocab.json'}: the checkpoint's head was trained over other ids than "
            f"the --init draft {_init_name(run)} proposes; resume with the --init it started "
            "from, or delete the directory to restart"
        )
    keep_vocab(ckpt_dir, vocab_ids)
    before = agreement(draft, parts, data, held, cfg.unroll)
    start = time.perf_counter()
    facts = train(
        draft,
        parts,
        data,
        ckpt_dir,
        epochs=cfg.epochs,
        batch_rows=cfg.batch_rows,
        lr=cfg.learning_rate,
        seed=cfg.seed,
        # The eagle kind predicts the target's features (and is read through its head); an
        # EAGLE-3 draft has its own head and is trained on the distribution alone, as published.
        reg_weight=0.0 if cfg.kind == "eagle3" else 1.0,
        unroll=cfg.unroll,
        resume=cfg.resume,
        progress=run.progress,
        rows=train_rows,
    )
    seconds = time.perf_counter() - start
    after = agreement(draft, parts, data, held, cfg.unroll)
    say(f"held-out top-1 agreement by draft position: {before} -> {after}")
    return (
        draft,
        vocab_ids,
        {
            "kind": cfg.kind,
            "init": _init_name(run),
            "training": {**facts, "seconds": round(seconds, 1)},
            "agreement": {"before": before, "after": after},
        },
    )


def _stage(run: _Run, draft: Any, vocab_ids: list[int], shape: dict) -> Path:
    """Write the draft into the work directory and make it the pair's drafter (to evaluate)."""
    pair = run.pair
    staged = run.work / "draft"
    shutil.rmtree(staged, ignore_errors=True)
    if run.config.kind == "eagle3":
        # Written as a published draft and read back by the code that runs downloaded ones.
        export(draft.checkpoint(vocab_ids), staged, FORMAT, dtype="float16")
        _copy_tokenizer(pair.target_path, staged)
        pair.drafter_factory = load_eagle3(staged, pair)
        pair.drafter_kind = "eagle3"
        return staged
    extra = {"target": pair.target_path.name, "seed": run.config.seed}
    save_draft(staged, draft, vocab_ids, shape, extra)
    _copy_tokenizer(pair.target_path, staged)
    pair.drafter_factory = load_draft(staged, pair)
    pair.drafter_kind = "eagle"
    return staged


def _output_dir(output: str) -> Path:
    if not isinstance(output, str) or not output:
        raise OptionError("give the draft a name or a directory: -o NAME")
    if _looks_like_path(output):
        return Path(output).expanduser().resolve()
    return store_root() / validate_name(output)


def _writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise OptionError(f"cannot write to {path}: {e.strerror or e}") from None


def _copy_tokenizer(src: Path, dest: Path) -> None:
    # The draft speaks the target's ids: `macspec check` and `macspec models` read these files.
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "chat_template.jinja",
        "vocab.json",
        "merges.txt",
    ):
        if (src / name).is_file():
            shutil.copy2(src / name, dest / name)


def _run(args: argparse.Namespace) -> int:
    distill(args.target, args.output, DistillConfig.from_args(args))
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "distill",
        help="train a draft for a target from the target itself (EAGLE-style)",
        description="Sample continuations from TARGET, train a feature-level draft on its hidden "
        "states, evaluate it on held-out prompts and write it (with report.json) to -o NAME.",
    )
    p.add_argument("target", help="target model: a directory or a store name")
    p.add_argument("-o", "--output", required=True, help="draft name in the store, or a directory")
    add_arguments(p)
    p.set_defaults(func=_run)
