"""The options of `macspec distill`, each defined once: name, default, check and help.

They are `distill()`'s keywords and the command's flags (--batch-rows for batch_rows), as
macspec/api/options.py does for the generation options.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ...api.options import check_count
from ...base.errors import OptionError

KINDS = ("eagle", "eagle3")


def _opt(default: Any, help: str, **cli: Any) -> Any:
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class DistillConfig:
    """A distill run's options. `init` (a draft directory or store name) continues training a
    draft of this run's kind for this target on this run's data: its weights, vocabulary and
    feature statistics are the start (`vocab` is not used; for eagle3, neither are `mlp` and
    `layers` beyond checking that they agree). `feature_layers`: "auto" (a low, a middle
    and a high layer, as EAGLE-3), "none" (the final features only) or comma-separated layer
    indices; by default "auto", or with `init` the layers that draft reads. An `init` draft
    reading the final features only can be given layers: it is widened, starting out exactly
    as it was (training.widen_draft). `layers`: the draft's decoder layers, by default 1 or
    the `init` draft's; more than that draft's adds layers that start as the identity
    (training.deepen_draft)."""

    kind: str = _opt(
        "eagle",
        "draft kind: eagle (macspec's own layout) or eagle3 (written as a published EAGLE-3 "
        "draft, vLLM speculators' layout)",
        choices=KINDS,
    )
    tokens: int = _opt(60_000, "target tokens to sample (with --corpus: ids of text to read)")
    prompts: str | None = _opt(None, "extra training prompts (text/JSON/JSONL)")
    corpus: str | None = _opt(
        None,
        "teacher-forced data from text files (a directory or one file) instead of sampled "
        "continuations: the target reads each piece of --max-new ids as its answer, at prefill "
        "speed",
        metavar="DIR|FILE",
    )
    self_prompts: int = _opt(
        0, "training prompts the target writes itself (Magpie: its chat template's open user turn)"
    )
    seed: int = _opt(0, "seed of the sampled data, the initial weights and the batch order")
    resume: bool = _opt(False, "continue an interrupted run")
    epochs: int = _opt(6, "passes over the sampled data")
    batch_rows: int = _opt(16, "sequences per training step")
    lr: float | None = _opt(
        None,
        "peak learning rate (AdamW; default 1e-3, for eagle3 1e-4: at 1e-3 the 1.5B target's "
        "EAGLE-3 draft diverged within 4 steps)",
        type=float,
    )
    vocab: int = _opt(8192, "ids the draft may propose (most frequent); 0 = all")
    max_new: int = _opt(128, "tokens sampled per continuation (with --corpus: ids per piece)")
    unroll: int = _opt(2, "training passes on the draft's own predicted features")
    feature_layers: str | None = _opt(
        None,
        "target layers the draft reads besides the final features: auto (a low, a middle and a "
        "high one; the default), none, or indices such as 2,15,27 (with --init: that draft's "
        "layers, or layers for a draft that has none)",
    )
    layers: int | None = _opt(
        None,
        "decoder layers of the draft (default 1, or with --init that draft's; more adds layers "
        "that start as the identity)",
        type=int,
    )
    mlp: int | None = _opt(
        None,
        "MLP width of the draft's decoder layers (default the target's); smaller is cheaper",
        type=int,
    )
    eval_tokens: int = _opt(96, "tokens per evaluation prompt")
    init: str | None = _opt(
        None,
        "continue training this draft, of the same --kind (its weights, vocabulary and "
        "feature statistics): e.g. on the target's own answers after a --corpus run",
        metavar="DRAFT",
    )
    force: bool = _opt(False, "replace an existing output")

    @property
    def learning_rate(self) -> float:
        """`lr`, or the kind's default."""
        if self.lr is not None:
            return self.lr
        return 1e-4 if self.kind == "eagle3" else 1e-3

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise OptionError(
                f"unknown kind {self.kind!r}: choose {' or '.join(KINDS)} (a from-scratch 'small' "
                "draft reached 0.35 agreement on this budget, see macspec/core/drafters/eagle.py)"
            )
        for name in ("tokens", "epochs", "batch_rows", "max_new", "unroll", "eval_tokens"):
            check_count(name, getattr(self, name), 1)
        if self.layers is not None:
            check_count("layers", self.layers, 1)
        if self.mlp is not None:
            check_count("mlp", self.mlp, 1)
        check_count("self_prompts", self.self_prompts, 0)

    @classmethod
    def of(cls, config: DistillConfig | None = None, **options: Any) -> DistillConfig:
        """`config` (or the defaults) with `options` set; OptionError for an unknown name."""
        unknown = set(options) - set(NAMES)
        if unknown:
            raise OptionError(
                f"unknown option(s) {', '.join(sorted(unknown))}; the options are "
                f"{', '.join(NAMES)}"
            )
        return replace(config, **options) if config is not None else cls(**options)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DistillConfig:
        return cls(**{name: getattr(args, name) for name in NAMES})


NAMES = tuple(f.name for f in fields(DistillConfig))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per option, with the option's default and help."""
    for f in fields(DistillConfig):
        flag = "--" + f.name.replace("_", "-")
        cli = {k: v for k, v in f.metadata.items() if k != "help"}
        if isinstance(f.default, bool):
            parser.add_argument(flag, action="store_true", help=f.metadata["help"], **cli)
            continue
        help_text = f.metadata["help"]
        if isinstance(f.default, (int, float)):
            help_text += f" (default {f.default})"
            cli["type"] = type(f.default)
        parser.add_argument(flag, default=f.default, help=help_text, **cli)
