"""`macspec chat`: the Textual chat app, or ANSI-coloured streaming with `--plain` or no tty."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..errors import OptionError
from .prompt import GENERATION_OPTIONS


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "chat",
        help="chat in the terminal, watching speculative decoding work",
        description="Chat with TARGET while DRAFT proposes tokens. Tokens are coloured by origin "
        "(accepted draft / target's own); the side panel shows per-round speedup against a "
        "plain target step measured on this machine. Without --target: the embedded default pair.",
    )
    p.add_argument("--target", help="target model directory or store name")
    p.add_argument("--draft", help="draft model directory or store name")
    p.add_argument(
        "--pair",
        metavar="NAME",
        help="a catalog pair (`macspec models --pairs`), fetched if missing",
    )
    p.add_argument("--drafter", help="drafting method when not a draft model")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-tokens", type=int, help="tokens per answer (engine default 256)")
    p.add_argument("--temperature", type=float, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--num-draft", type=int, help="K, the most draft tokens per round (default 4)")
    p.add_argument("--seed", type=int, help="random seed, for reproducible sampling")
    p.add_argument(
        "--no-adaptive",
        dest="adaptive",
        action="store_false",
        default=None,
        help="always draft K tokens (default: K adapts to acceptance and measured speed)",
    )
    p.add_argument(
        "--plain",
        action="store_true",
        help="ANSI-coloured text on stdout instead of the app (automatic when stdout is no tty)",
    )
    p.add_argument(
        "-p", "--prompt", help="plain mode: answer this one message and exit (else read stdin)"
    )
    p.set_defaults(func=run)


def _load_pair(args: argparse.Namespace) -> Any:
    import macspec

    target, draft = args.target, args.draft
    if args.pair:
        if target or draft:
            raise OptionError("--pair names both models: leave out --target/--draft")
        target, draft = _catalog_pair(args.pair)
    kwargs = {"drafter": args.drafter} if args.drafter else {}
    from ..engine.distributed import init_group, serve_if_follower

    # Under mlx.launch the target is sharded: the chat runs on rank 0, the other ranks serve it.
    pair = macspec.load(target, draft, group=init_group(), **kwargs)
    serve_if_follower(pair)
    return pair


def _catalog_pair(name: str) -> tuple[Any, Any]:
    try:
        from ..models.store import ensure_pair  # the pair catalog; fetches what is missing
    except ImportError:
        raise OptionError(
            f"--pair {name}: this build has no pair catalog; use --target and --draft"
        ) from None
    return ensure_pair(name)


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The generation keywords the user set (None = leave the engine's default)."""
    return {k: getattr(args, k) for k in GENERATION_OPTIONS if getattr(args, k, None) is not None}


def run(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    plain = args.plain or args.prompt is not None or not sys.stdout.isatty()
    pair = _load_pair(args)  # load errors reach the CLI as `macspec: error: ...`
    if plain:
        from .plain import run_plain

        return run_plain(pair, options, system=args.system, prompt=args.prompt)
    from .app import create_app

    create_app(pair, system=args.system, **options).run()
    return 0
