"""What the commands that run a pair share (`generate`, `chat`, `serve`): the model flags, the
generation options' flags (from macspec/api/options.py), and loading the pair."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from time import perf_counter
from typing import Any, TextIO

from ..api import options
from ..api.drafters import DRAFTERS
from ..api.pair import DRAFT_CONTEXT, Pair
from ..base.errors import OptionError


def add_pair_args(p: argparse.ArgumentParser) -> None:
    """--target/--draft/--pair/--drafter, then one flag per generation option."""
    p.add_argument("--target", help="target model: directory or store name (default: embedded)")
    p.add_argument("--draft", help="draft model: directory or store name")
    p.add_argument(
        "--pair",
        metavar="NAME",
        help="a catalog pair (`macspec models --pairs`), fetched if missing",
    )
    p.add_argument(
        "--drafter",
        choices=list(DRAFTERS),
        help="; ".join(f"'{k}': {v}" for k, v in DRAFTERS.items())
        + " (default: an n-gram copy when the context repeats, else the draft model)",
    )
    p.add_argument(
        "--draft-context",
        type=int,
        metavar="N",
        default=DRAFT_CONTEXT,
        help=f"the draft model reads only a prompt's last N ids (default {DRAFT_CONTEXT}; 0: all); "
        "the answer is the same, only the time to the first token and the drafts change",
    )
    options.add_arguments(p)


def load_pair(args: argparse.Namespace) -> Pair:
    """The pair the flags name; under mlx.launch, ranks > 0 serve rank 0 and exit in here."""
    from ..api.pair import load
    from ..core.sharded import init_group, serve_if_follower

    target, draft = args.target, args.draft
    if args.pair:
        if target or draft:
            raise OptionError("--pair names both models: leave out --target/--draft")
        from ..models.catalog import ensure_pair

        target, draft = ensure_pair(args.pair)
    # Decoding plainly needs no costs: not the seconds of measuring them before its first token.
    measure = options.from_args(args).get("speculative", options.DEFAULTS.speculative)
    pair = load(
        target,
        draft,
        drafter=args.drafter,
        group=init_group(),
        measure=measure,
        draft_context=args.draft_context,
    )
    serve_if_follower(pair)
    return pair


def announce(pair: Pair) -> str:
    """The lines a command prints on stderr about the loaded pair."""
    line = f"[macspec] {pair.describe()}"
    if pair.calibration_time:
        line += f"\n[macspec] {pair.calibration_note()}"
    return line


def generation_options(args: argparse.Namespace) -> dict[str, Any]:
    return options.from_args(args)


def reading_line(err: TextIO) -> Callable[[int, int], None] | None:
    """On a terminal, a line counting a long prompt's ids as they are read (a pasted file takes
    seconds to minutes on a CPU), erased once all are; elsewhere (a pipe, a log) nothing."""
    if not err.isatty():
        return None
    shown, began = False, perf_counter()  # the reading starts as the generation does

    def told(read: int, total: int) -> None:
        nonlocal shown
        if read < total:
            left = (perf_counter() - began) * (total - read) / read  # at the rate so far
            share = f"{read / total:.0%}, about {_duration(left)} left"
            err.write(f"\r[macspec] reading the prompt: {read:,} of {total:,} ids ({share})\033[K")
            shown = True
        elif shown:
            err.write("\r\033[K")  # the line erased: the answer follows
            shown = False
        err.flush()

    return told


def _duration(seconds: float) -> str:
    """ "45 s", "3 min 20 s": a wait as a person reads it."""
    whole = max(1, round(seconds))
    return f"{whole} s" if whole < 60 else f"{whole // 60} min {whole % 60} s"
