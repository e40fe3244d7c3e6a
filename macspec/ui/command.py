"""`macspec chat`: the Textual chat app, or ANSI-coloured streaming with `--plain` or no tty."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..cli.common import add_pair_args, announce, generation_options, load_pair

# The app's frames a second where the CPU also generates. Textual paints up to 60 a second; on a
# 2-core CPU that drawing takes time from the answer (a haiku: 38 tok/s at 60 frames, 42 at 30,
# 48 at 15, 56 with no app; docs/chat.md). A user's own TEXTUAL_FPS stands.
CPU_FPS = 15


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "chat",
        help="chat in the terminal, watching speculative decoding work",
        description="Chat with TARGET while DRAFT proposes tokens. Tokens are coloured by origin "
        "(accepted draft / target's own); the side panel shows per-round speedup against a "
        "plain target step measured on this machine. Without --target: the embedded default pair.",
    )
    add_pair_args(p)
    p.add_argument("--system", help="system prompt")
    p.add_argument(
        "--plain",
        action="store_true",
        help="ANSI-coloured text on stdout instead of the app (automatic when stdout is no tty)",
    )
    p.add_argument(
        "-p", "--prompt", help="plain mode: answer this one message and exit (else read stdin)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    options = generation_options(args)
    plain = args.plain or args.prompt is not None or not sys.stdout.isatty()
    pair = load_pair(args)  # load errors reach the CLI as `macspec: error: ...`
    if plain:
        from .plain import run_plain

        print(announce(pair), file=sys.stderr)
        return run_plain(pair, options, system=args.system, prompt=args.prompt)
    _frame_rate()
    from .app import create_app

    create_app(pair, system=args.system, **options).run()
    return 0


def _frame_rate() -> None:
    """CPU_FPS for Textual where MLX computes on the CPU (Textual reads it once, when it is
    first imported: here, unless something imported it before)."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu and "textual.screen" not in sys.modules:
        os.environ.setdefault("TEXTUAL_FPS", str(CPU_FPS))
